"""``docs/results.md``: the current results, generated from the files under ``bench/results/``.

What the page shows, and from where (nothing is typed in by hand):

* "Never slower than plain decoding": ``bench/results/goals.json`` (``bench/goals.py``)
  as a table, and every later, smaller goals file a run directory holds
  (``bench/results/<dir>/goals-*.json``), newest first;
* "Lossless": ``bench/results/equivalence.json`` (``bench/equivalence.py``), per case;
* a plot of the goals table, ``docs/results-goals.svg`` (DDTree / plain decoding against
  batch size, per suite and temperature, the pooled median and each file's own ratio;
  plain SVG, no plotting library);
* "Runs": one line per dated run directory (``bench/results/YYYY-MM-DD-*/``), its
  ``COMMANDS.md`` title and link (else the docs/benchmarks.md heading naming it),
  newest first.

CI regenerates the page and the plot and fails when a committed one differs
(``tests/bench/test_results_page.py``), so a new result file and the page land together.

    python3 bench/results_page.py            # rewrites docs/results.md and the plot
    python3 bench/results_page.py --check    # exit 1 when either is stale
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.goals import table as goals_table  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
PAGE = os.path.join(ROOT, "docs", "results.md")
GOALS_PLOT = "results-goals.svg"  # next to PAGE
RUN_DIR = re.compile(r"^\d{4}-\d{2}-\d{2}-")


def _rel(path: str) -> str:
    """A link from docs/ to ``path``."""
    return os.path.relpath(path, os.path.dirname(PAGE)).replace(os.sep, "/")


def _goals_section(path: str, heading: str) -> list[str]:
    with open(path) as f:
        doc = json.load(f)
    cells = doc.get("cells") or []
    met = sum(1 for c in cells if c.get("goal_met"))
    revs = doc.get("git_rev")
    revs = revs if isinstance(revs, list) else [revs]
    rev = ", ".join(f"`{r}`" for r in revs)
    out = [heading, "",
           f"From [`{os.path.relpath(path, ROOT)}`]({_rel(path)}); held out: "
           f"`{doc.get('prompt_set_held_out')}`; recorded revision{'s' if len(revs) > 1 else ''}: {rev} "
           "(the runs' `git_rev`: a GPU host's copy may carry a stale `.git`, so the run "
           "directory's COMMANDS.md names the tree and its `code_digest`). "
           f"{doc.get('goal', '')}: met in {met} of {len(cells)} cells.", ""]
    for src in doc.get("sources") or []:
        order = ", ".join(src.get("engine_order") or [])
        gpu = f", {src['gpu']}" if src.get("gpu") else ""
        out.append(f"- `{src.get('file')}` (engines in order: {order}{gpu}): "
                   f"`{src.get('command')}`")
    out += ["", goals_table(cells).rstrip("\n"), ""]
    return out


def _lossless_section(path: str) -> list[str]:
    with open(path) as f:
        doc = json.load(f)
    s = doc.get("summary", {})
    out = ["## Lossless: DDTree's tokens against decoding without speculation", "",
           f"From [`{os.path.relpath(path, ROOT)}`]({_rel(path)}): "
           f"{s.get('ddtree_identical')} of {s.get('ddtree_total')} DDTree outputs identical "
           f"({s.get('ddtree_differing_near_ties')} of the others analysed as near ties); "
           f"{s.get('identical')} of {s.get('total')} over every case, controls included. "
           f"Command: `{doc.get('command')}`.", "",
           "| target | method | config | dtype | graphs | batch | sampling | scenario | "
           "identical | near ties |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for c in doc.get("cases") or []:
        out.append(
            f"| {c.get('target')} | {c.get('method')} | {c.get('config')} | {c.get('dtype')} | "
            f"{'yes' if c.get('graphs') else 'no'} | {c.get('batch')} | {c.get('sampling')} "
            f"(T={c.get('temperature')}) | {c.get('scenario')} | "
            f"{c.get('identical')}/{c.get('total')} | {c.get('differing_near_ties', '')} |")
    out.append("")
    return out


def _title(commands_md: str) -> str:
    with open(commands_md) as f:
        for line in f:
            if line.startswith("#"):
                return line.lstrip("#").strip()
    return ""


def _benchmarks_heading(run_dir: str) -> str:
    """The docs/benchmarks.md heading that names ``run_dir`` (runs from before each run
    directory had its COMMANDS.md are described there), or ''."""
    path = os.path.join(os.path.dirname(PAGE), "benchmarks.md")
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        for line in f:
            if line.startswith("#") and run_dir in line:
                return line.lstrip("#").split(" (`")[0].strip()
    return ""


def run_dirs(results: str = RESULTS) -> list[str]:
    """Dated run directories, newest first (by name, which starts with the date)."""
    return sorted((d for d in os.listdir(results)
                   if RUN_DIR.match(d) and os.path.isdir(os.path.join(results, d))),
                  reverse=True)


def goals_svg(cells: list[dict]) -> str:
    """DDTree / plain decoding against batch size (log2 axis), one panel per suite and
    temperature (and vLLM version and GPU, where cells of several are present): the pooled median (line) and each result file's own ratio (dots);
    dashed lines at 1 (plain decoding) and at the goal, 0.97."""
    panels: dict = {}
    for c in cells:
        if "ddtree_vs_no_spec" in c:
            panels.setdefault((c.get("vllm_version") or "", c.get("gpu") or "",
                               c.get("suite") or "", c["temperature"]), []).append(c)
    if not panels:
        return ""
    ratios = [r for cs in panels.values() for c in cs
              for r in [c["ddtree_vs_no_spec"], *c.get("ddtree_vs_no_spec_by_file", [])]]
    lo = min(0.8, math.floor(min(ratios) * 10) / 10)
    hi = max(1.2, math.ceil(max(ratios) * 10) / 10)
    batches = sorted({c["batch"] for cs in panels.values() for c in cs})
    bx = {b: i for i, b in enumerate(batches)}
    w, h, pad_l, pad_t, pad_b = 300, 220, 44, 28, 34
    pw, ph = w - pad_l - 12, h - pad_t - pad_b
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * len(panels)}" height="{h}" '
           'font-family="sans-serif" font-size="11">']
    versions = {v for v, _, _, _ in panels}
    gpus = {g for _, g, _, _ in panels}
    for k, ((version, gpu, suite, temp), cs) in enumerate(sorted(panels.items())):
        x0 = k * w + pad_l

        def x(b):
            return x0 + (pw * bx[b] / max(len(batches) - 1, 1))

        def y(r):
            return pad_t + ph * (hi - r) / (hi - lo)
        on = ", ".join(([f"vLLM {version}"] if len(versions) > 1 else [])
                       + ([gpu.replace("NVIDIA ", "")] if len(gpus) > 1 else []))
        on = f" ({on})" if on else ""
        out.append(f'<text x="{x0}" y="16">{suite}, T={temp:g}{on}: DDTree / plain decoding</text>')
        out.append(f'<rect x="{x0}" y="{pad_t}" width="{pw}" height="{ph}" fill="none" '
                   'stroke="#999"/>')
        for r, dash in ((1.0, "4 3"), (0.97, "1 3")):
            out.append(f'<line x1="{x0}" x2="{x0 + pw}" y1="{y(r):.1f}" y2="{y(r):.1f}" '
                       f'stroke="#555" stroke-dasharray="{dash}"/>')
        for t in range(int(round(lo * 10)), int(round(hi * 10)) + 1, 2):
            out.append(f'<text x="{x0 - 4}" y="{y(t / 10) + 4:.1f}" text-anchor="end">'
                       f'{t / 10:.1f}</text>')
        for b in batches:
            out.append(f'<text x="{x(b):.1f}" y="{pad_t + ph + 14}" text-anchor="middle">{b}</text>')
        out.append(f'<text x="{x0 + pw / 2}" y="{h - 4}" text-anchor="middle">batch size</text>')
        cs = sorted(cs, key=lambda c: c["batch"])
        points = " ".join(f"{x(c['batch']):.1f},{y(c['ddtree_vs_no_spec']):.1f}" for c in cs)
        out.append(f'<polyline points="{points}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
        for c in cs:
            for r in c.get("ddtree_vs_no_spec_by_file", []):
                out.append(f'<circle cx="{x(c["batch"]):.1f}" cy="{y(r):.1f}" r="3" '
                           'fill="#ff7f0e" fill-opacity="0.7"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def render_goals_plot(results: str = RESULTS) -> str:
    goals = os.path.join(results, "goals.json")
    if not os.path.exists(goals):
        return ""
    with open(goals) as f:
        return goals_svg(json.load(f).get("cells") or [])


def render(results: str = RESULTS) -> str:
    lines = ["# Current results", "",
             "Generated by `python3 bench/results_page.py` from the files under "
             "`bench/results/`; do not edit by hand (CI fails when this page is older than "
             "its files). Measured on the GPUs lent to the project (an H200, and an H100 where a "
             "run names it); how each number was "
             "made is in the run's `COMMANDS.md`, what it means in "
             "[benchmarks.md](benchmarks.md).", ""]
    goals = os.path.join(results, "goals.json")
    if os.path.exists(goals):
        lines += _goals_section(goals, "## Never slower than plain decoding (`goals.json`)")
        if render_goals_plot(results):
            lines += [f"![DDTree / plain decoding by batch size: the pooled median (line), each "
                      f"file's ratio (dots), plain decoding (dashed) and the goal (dotted)]"
                      f"({GOALS_PLOT})", ""]
    for d in run_dirs(results):
        for path in sorted(glob.glob(os.path.join(results, d, "goals-*.json"))):
            lines += _goals_section(path, f"### Later run: `{d}/{os.path.basename(path)}`")
    equivalence = os.path.join(results, "equivalence.json")
    if os.path.exists(equivalence):
        lines += _lossless_section(equivalence)
    lines += ["## Runs", "", "| run | what it measured |", "|---|---|"]
    for d in run_dirs(results):
        commands = os.path.join(results, d, "COMMANDS.md")
        if os.path.exists(commands):
            lines.append(f"| [`{d}`]({_rel(commands)}) | {_title(commands)} |")
        else:
            heading = _benchmarks_heading(d)
            lines.append(f"| `{d}` | {heading + ' (benchmarks.md)' if heading else ''} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 (writing nothing) when docs/results.md is not current")
    args = ap.parse_args(argv)
    plot = os.path.join(os.path.dirname(PAGE), GOALS_PLOT)
    files = {PAGE: render(), plot: render_goals_plot()}
    if args.check:
        stale = [path for path, text in files.items()
                 if (open(path).read() if os.path.exists(path) else "") != text]
        for path in stale:
            print(f"{os.path.relpath(path, ROOT)} is stale: run python3 bench/results_page.py",
                  file=sys.stderr)
        return 1 if stale else 0
    for path, text in files.items():
        if text:
            with open(path, "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
