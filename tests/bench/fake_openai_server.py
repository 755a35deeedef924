"""A stand-in for `vllm serve` used by tests/bench/test_serve_e2e.py (CPU, no model).

Invoked like the vLLM CLI, ``fake_openai_server.py serve TARGET --speculative-config
JSON --port P ...``, it mimics what bench/serve_e2e.py relies on: refusals of bad DDTree
configs at startup (exit 1 with vllm_ddtree's wording), /health, /v1/models,
/v1/completions and /v1/chat/completions (streamed as SSE, with ``return_token_ids``),
the 4xx answers of a speculative-decoding server, and spec-decode Prometheus counters. Greedy
"generation" is a deterministic function of the prompt.

FAKE_MODE (environment) injects faults: ``die`` exits at startup, ``no_health`` never
answers /health with 200, ``logprobs_500`` answers a logprobs request with HTTP 500,
``short`` stops streams one token early, ``bad_json`` answers a JSON-schema request
with text that is not JSON, ``ignore_term`` ignores SIGTERM (so that only SIGKILL ends
it).
"""
import argparse
import asyncio
import json
import os
import signal
import sys
import zlib

from aiohttp import web

MODE = os.environ.get("FAKE_MODE", "")
COUNTERS = {"drafts": 0, "accepted": 0}


def tokens_for(prompt: str, n: int) -> list[int]:
    seed = zlib.crc32(prompt.encode())
    return [(seed + 7 * i) % 1000 for i in range(n)]


def completion_for(prompt_ids: list[int], n: int) -> list[int]:
    """The fake's greedy continuation: a function of the prompt's token ids, so that
    tests/bench/fake_offline_worker.py (which sees only the ids) can reproduce it.
    Started without --speculative-config under FAKE_MODE=plain_differs, the last token
    differs (a plain server that disagrees with the speculative one)."""
    ids = tokens_for(json.dumps(prompt_ids), n)
    if PLAIN and MODE == "plain_differs" and ids:
        ids[-1] += 1
    return ids


def text_of(ids) -> str:
    return "".join(f" t{i}" for i in ids)


def logprob_of(token: int, position: int) -> float:
    """The fake's logprob of the token it emits at ``position`` (the offline stand-in
    computes the same)."""
    return -0.1 - 0.001 * ((token + position) % 50)


def logprobs_entry(ids: list[int], first: int = 0) -> dict:
    return {"tokens": [f" t{i}" for i in ids],
            "token_logprobs": [logprob_of(t, first + k) for k, t in enumerate(ids)],
            "top_logprobs": [{f" t{i}": -0.1, f" t{i + 1}": -2.0} for i in ids]}


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequestError",
                                        "code": status}}, status=status)


async def read_json(request):
    try:
        return json.loads(await request.text()), None
    except json.JSONDecodeError as exc:
        return None, error(400, f"JSON decode error: {exc}")


def refusal(body: dict, chat: bool):
    if body.get("model") != request_model:
        return error(404, f"The model `{body.get('model')}` does not exist.")
    if MODE == "logprobs_500" and body.get("logprobs"):
        return web.Response(status=500, text="Internal Server Error")
    if body.get("logit_bias"):
        return error(400, "The min_p and logit_bias sampling parameters are not yet "
                          "supported with speculative decoding.")
    if body.get("max_tokens") is not None and body["max_tokens"] < 1:
        return error(400, f"max_tokens must be at least 1, got {body['max_tokens']}.")
    return None


async def sse(request, chunks):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for chunk in chunks:
        # Split each event in two writes to exercise partial-line parsing.
        data = f"data: {json.dumps(chunk)}\n\n".encode()
        await resp.write(data[:7])
        await resp.write(data[7:])
        await asyncio.sleep(0)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def completions(request):
    body, err = await read_json(request)
    if err:
        return err
    err = refusal(body, chat=False)
    if err:
        return err
    if body.get("prompt_logprobs") and body.get("stream"):  # as vLLM's request validation
        return web.json_response(
            {"error": {"message": "`prompt_logprobs` are not available when `stream=True`.",
                       "type": "BadRequestError", "code": 400}}, status=400)
    n = body.get("max_tokens") or 16
    prompt_ids = tokens_for("p" + body["prompt"], 5)
    ids = completion_for(prompt_ids, n)
    COUNTERS["drafts"] += 1 + n // 4
    COUNTERS["accepted"] += n
    if body.get("structured_outputs"):
        # A grammar-constrained answer (FAKE_MODE=bad_json: one that ignores it) in one
        # chunk when streamed.
        text = "not json" if MODE == "bad_json" else json.dumps({"name": text_of(ids[:2])})
        choice = {"index": 0, "text": text, "finish_reason": "stop"}
        if body.get("return_token_ids"):
            choice.update(token_ids=ids, prompt_token_ids=prompt_ids)
        if not body.get("stream"):
            return web.json_response({"object": "text_completion", "choices": [choice]})
        return await sse(request, [{"choices": [choice]}])
    if not body.get("stream"):
        choice = {"index": 0, "text": text_of(ids), "finish_reason": "length"}
        if body.get("logprobs"):
            choice["logprobs"] = logprobs_entry(ids)
        if body.get("prompt_logprobs"):
            choice["prompt_logprobs"] = [None] + [
                {str(t): {"logprob": logprob_of(t, -k), "rank": 1}}
                for k, t in enumerate(prompt_ids[1:], 1)]
        if body.get("return_token_ids"):
            choice.update(token_ids=ids, prompt_token_ids=prompt_ids)
        return web.json_response({"object": "text_completion", "choices": [choice],
                                  "usage": {"completion_tokens": n}})
    if MODE == "short":
        ids = ids[:-1]
    chunks = []
    for k, tok in enumerate(ids):
        choice = {"index": 0, "text": text_of([tok]), "finish_reason": None}
        if body.get("logprobs"):
            choice["logprobs"] = logprobs_entry([tok], k)
        if body.get("return_token_ids"):
            choice["token_ids"] = [tok]
            if k == 0:
                choice["prompt_token_ids"] = prompt_ids
        chunks.append({"choices": [choice]})
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({"choices": [], "usage": {"completion_tokens": len(ids)}})
    return await sse(request, chunks)


async def chat(request):
    body, err = await read_json(request)
    if err:
        return err
    err = refusal(body, chat=True)
    if err:
        return err
    ids = tokens_for(body["messages"][-1]["content"], body.get("max_tokens") or 16)
    if body.get("response_format") and not body.get("stream"):
        # A grammar-constrained answer (FAKE_MODE=bad_json: one that ignores it).
        content = "not json" if MODE == "bad_json" else json.dumps({"name": text_of(ids[:2])})
        return web.json_response({"choices": [{"index": 0, "message": {
            "role": "assistant", "content": content}}]})
    if not body.get("stream"):
        return web.json_response({"choices": [{"index": 0, "message": {
            "role": "assistant", "content": text_of(ids)}}]})
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": text_of([t])}}]} for t in ids]
    return await sse(request, chunks)


async def health(request):
    return web.Response(status=503 if MODE == "no_health" else 200)


async def models(request):
    return web.json_response({"object": "list", "data": [{"id": request_model, "object": "model"}]})


async def metrics(request):
    lines = [
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="{request_model}"}} {float(COUNTERS["drafts"])}',
        f'vllm:spec_decode_num_drafts_created{{engine="0",model_name="{request_model}"}} 1.7e9',
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="{request_model}"}} {float(COUNTERS["accepted"])}',
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="0"}} {float(COUNTERS["drafts"])}',
        "vllm:num_requests_running 0.0",
    ]
    return web.Response(text="\n".join(lines) + "\n")


def main():
    global request_model
    p = argparse.ArgumentParser()
    p.add_argument("cmd")
    p.add_argument("target")
    p.add_argument("--speculative-config")
    p.add_argument("--port", type=int, default=8000)  # vLLM's defaults
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--served-model-name")
    args, _ = p.parse_known_args()
    global PLAIN
    PLAIN = not args.speculative_config  # plain decoding: vLLM's server without speculation
    spec = json.loads(args.speculative_config or '{"num_speculative_tokens": 0}')
    if spec.get("ddtree_max_depth", 15) > 15:
        sys.exit(f"ValueError: ddtree: ddtree_max_depth={spec['ddtree_max_depth']} is out of "
                 "range; it must be between 1 and 15.")
    if spec["num_speculative_tokens"] > 512:
        sys.exit(f"ValueError: ddtree: num_speculative_tokens (tree budget)="
                 f"{spec['num_speculative_tokens']} is out of range; it must be between 1 and 512.")
    if MODE == "die":
        print("RuntimeError: fake startup failure", file=sys.stderr)
        sys.exit(3)
    request_model = args.served_model_name or args.target
    if MODE == "defaults_die" and not args.served_model_name:
        print("ValueError: fake failure on vLLM's defaults", file=sys.stderr)
        sys.exit(1)
    print(f"INFO ddtree: fake server on port {args.port}", file=sys.stderr)
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    ignore_term = MODE == "ignore_term"
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=not ignore_term)


request_model = None
PLAIN = False

if __name__ == "__main__":
    main()
