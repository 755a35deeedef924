"""PNG plots of a ``bench/run.py`` result: tokens/s and tau against batch size.

    python bench/plot.py bench/results/bench-fixture.json.gz --out-dir bench/results/plots

One figure per (prompt set, temperature): output tokens/s (left) and tau (right)
against batch size, one line per configuration. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # run as a file: make `bench` importable

from bench.result_files import read_json  # noqa: E402


def series_by_panel(doc: dict) -> dict:
    """{(prompt_set, temperature): {config: [(batch, tokens/s, tau), ...]}}"""
    panels: dict = defaultdict(lambda: defaultdict(list))
    for r in doc.get("results", []):
        panels[(r["prompt_set"], r["temperature"])][r["config"]].append(
            (r["batch_size"], r.get("output_tokens_per_s"), r.get("tau")))
    for cfgs in panels.values():
        for pts in cfgs.values():
            pts.sort()
    return panels


def plot_results(doc: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
    suite = doc.get("suite", "bench")
    for (pset, temp), cfgs in sorted(series_by_panel(doc).items()):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for cfg, pts in sorted(cfgs.items()):
            xs = [p[0] for p in pts]
            ax1.plot(xs, [p[1] for p in pts], marker="o", label=cfg)
            taus = [(p[0], p[2]) for p in pts if p[2] is not None]
            if taus:
                ax2.plot([t[0] for t in taus], [t[1] for t in taus], marker="o", label=cfg)
        for ax, ylabel in ((ax1, "output tokens/s"), (ax2, "tau (tokens per target forward)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size (concurrent requests)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        ax1.legend(fontsize=8)
        fig.suptitle(f"{suite}: {pset}, T={temp:g} ({doc.get('gpu')}, vLLM {doc.get('vllm_version')}, "
                     f"rev {doc.get('git_rev')}"
                     + (f", code {doc['code_digest']}" if doc.get("code_digest") else "") + ")",
                     fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{suite}-{pset}-T{temp:g}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result")
    ap.add_argument("--out-dir", required=True)
    a = ap.parse_args(argv)
    doc = read_json(a.result)
    for p in plot_results(doc, a.out_dir):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
