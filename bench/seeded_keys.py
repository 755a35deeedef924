"""Which Gumbel keys each engine samples with: a diagnostic for seeded T > 0 runs that
differ from decoding without speculation.

vLLM draws a seeded request's token as argmax(logits / T + Gumbel(seed, position)).
This script wraps vLLM's ``gumbel_sample`` as its sampler imported it (plain decoding's
and DDTree's tree sampler draw through it; the chain's rejection sampler has its own
kernel) in an in-process engine and records, for every call of the first steps, each
logit row's request slot, temperature, seed and position and the token drawn; then it
generates the same seeded requests without speculation and with each speculative
configuration, and prints the first keys and tokens of each side by side. A position or
seed that differs for the same output index names the bookkeeping error; equal keys and
different tokens point at the logits.

    python3 bench/seeded_keys.py --shape qwen3 --configs ddtree-b32 ddtree-b32+static dflash
    python3 bench/seeded_keys.py --target /opt/smollm2-hf --drafter bench/fixture/smollm2-dflash

Configurations are bench/run.py's names (``+static``, ``+unfused``, ...).

Needs a GPU and the series applied (bench/gpu_session.sh applies it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.gpu_checks import _engine, _free, _prompts, make_tiny_models, request_seed  # noqa: E402
from bench.run import config_engine_kwargs, engine_environment, parse_config  # noqa: E402

CALLS: list[dict] = []


def _install_recorder(max_calls: int) -> None:
    """Wrap gumbel_sample where vLLM's sampler imported it (once per process)."""
    import vllm.v1.worker.gpu.sample.sampler as mod

    inner = mod.gumbel_sample

    def wrapped(logits, idx_mapping, temperature, seeds, pos, *a, **kw):
        out = inner(logits, idx_mapping, temperature, seeds, pos, *a, **kw)
        if len(CALLS) < max_calls:
            idx = idx_mapping.long()
            CALLS.append(dict(
                rows=int(logits.shape[0]), slot=idx.tolist(),
                temp=[round(float(t), 4) for t in temperature[idx]],
                seed=seeds[idx].tolist(), pos=pos.tolist(), token=out.view(-1).tolist(),
                argmax=logits.argmax(-1).tolist()))
        return out

    mod.gumbel_sample = wrapped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3", help="tiny random target shape (dummy weights)")
    ap.add_argument("--target", help="a real target instead of a tiny random one")
    ap.add_argument("--drafter", help="its drafter")
    ap.add_argument("--configs", nargs="+", default=["ddtree-b32", "ddtree-b32+static", "dflash"],
                    help="bench/run.py configuration names")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--max-calls", type=int, default=12)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from vllm import SamplingParams

    dummy = args.target is None
    if dummy:
        target, drafter = make_tiny_models(tempfile.mkdtemp(), args.shape)
    else:
        target, drafter = args.target, args.drafter
    prompts = _prompts(args.batch)
    params = [SamplingParams(temperature=args.temperature, seed=request_seed("seeded", i),
                             top_k=args.top_k, top_p=args.top_p, max_tokens=args.max_tokens,
                             ignore_eos=True)
              for i in range(args.batch)]
    _install_recorder(args.max_calls)
    report = dict(target=target if not dummy else f"tiny-{args.shape}", batch=args.batch,
                  temperature=args.temperature, eager=args.eager, engines=[])
    for config in ["no-spec"] + list(args.configs):
        cfg = parse_config(config)
        with engine_environment(dict(cfg.env)):
            llm = _engine(target, cfg.speculative_config(drafter), args.eager, dummy, "float32",
                          **config_engine_kwargs(cfg))
        CALLS.clear()  # the engine's warm-up draws
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        report["engines"].append(dict(config=config, tokens=tokens, calls=list(CALLS)))
        print(json.dumps(dict(config=config, tokens=tokens)), flush=True)
        for c in CALLS[:6]:
            print("  ", json.dumps(c)[:400], flush=True)
        _free(llm)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
