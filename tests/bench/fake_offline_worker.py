"""A stand-in for ``serve_e2e.py --offline-worker`` (CPU, no model), used by
tests/bench/test_serve_e2e.py: reads the reference spec, writes the greedy outputs
tests/bench/fake_openai_server.py would give for the same prompt token ids.

FAKE_OFFLINE_DIFFER=<reference> makes that reference's second output differ from its
fourth token on (``features``: the second feature request's); FAKE_OFFLINE_FAIL=<reference>
makes it exit 1 without output. With ``explain`` in the spec it answers every first
divergence with the margin serve_e2e's worker would compute, from made-up logprobs: the
two tokens FAKE_OFFLINE_GAP apart (default 0.5, not a near tie).
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from bench.serve_e2e import first_divergences, margin_entry  # noqa: E402
from fake_openai_server import completion_for, logprob_of, text_of  # noqa: E402


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    reference = spec["reference"]
    if os.environ.get("FAKE_OFFLINE_FAIL") == reference:
        print(f"fake offline worker: {reference} fails", flush=True)
        return 1
    if reference == "same-config":
        assert spec["speculative_config"]["method"] == "ddtree", spec
    else:
        assert "speculative_config" not in spec, spec
    ids = [completion_for(p, spec["max_tokens"]) for p in spec["prompts"]]
    if os.environ.get("FAKE_OFFLINE_DIFFER") == reference and len(ids) > 1:
        ids[1] = ids[1][:3] + [t + 1 for t in ids[1][3:]]
    result = {"init_s": 0.0, "generate_s": 0.0, "token_ids": ids,
              "texts": [text_of(x) for x in ids]}
    if spec.get("explain") is not None:
        gap = float(os.environ.get("FAKE_OFFLINE_GAP", "0.5"))
        margins = {label: [] for label in spec["explain"]}
        for d in first_divergences(spec["explain"], ids):
            lps = {d["a_token"]: -1.0, d["b_token"]: -1.0 - gap}
            margins[d["label"]].append(margin_entry(d, lps, d["a_token"]))
        result["margins"] = margins
    if spec.get("requests"):
        result["requests"] = []
        for k, r in enumerate(spec["requests"]):
            out = completion_for(r["prompt_token_ids"], r["params"]["max_tokens"])
            if os.environ.get("FAKE_OFFLINE_DIFFER") == "features" and k == 1:
                out = out[:3] + [t + 1 for t in out[3:]]
            lps = ([logprob_of(t, i) for i, t in enumerate(out)]
                   if r["params"].get("logprobs") else None)
            prompt = r["prompt_token_ids"]
            plps = ([None] + [logprob_of(t, -k) for k, t in enumerate(prompt[1:], 1)]
                    if r["params"].get("prompt_logprobs") else None)
            result["requests"].append({"check": r["check"], "token_ids": out, "logprobs": lps,
                                       "prompt_logprobs": plps})
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
