#!/usr/bin/env python3
"""Which host functions make one engine's step slower than another's: the per-step
own time (cProfile's tottime) of two ``bench/profile_step.py`` profiles side by side.

``profile_step.py`` (``--engine-process inproc``) writes
``profile-<config>-cprofile.txt``, the top functions by own time over a whole
generation. Steps differ in number between engines (speculation emits several
tokens per step), so times are divided by each run's engine steps, counted as the
calls of the scheduler's ``schedule``. Functions missing from a top list count as 0
there (their time was below that list's cut).

    python bench/compare_profiles.py profile/profile-no-spec-cprofile.txt \\
        profile/profile-ddtree-b64-t512-d4-cprofile.txt --top 20
"""

from __future__ import annotations

import argparse
import re
import sys

_ROW = re.compile(
    r"^\s*(?P<ncalls>\d+)(?:/\d+)?\s+(?P<tottime>[\d.]+)\s+[\d.]+\s+(?P<cumtime>[\d.]+)\s+"
    r"[\d.]+\s+(?P<func>.+?)\s*$"
)
STEP_FUNCTION = "scheduler.py"
STEP_NAME = "(schedule)"


def parse_cprofile(text: str) -> dict[str, dict[str, float]]:
    """Rows of the first table (by own time): function -> ncalls, tottime, cumtime."""
    rows: dict[str, dict[str, float]] = {}
    in_table = False
    for line in text.splitlines():
        if line.lstrip().startswith("ncalls"):
            if in_table:
                break  # the second table (by cumulative time) repeats functions
            in_table = True
            continue
        if in_table:
            m = _ROW.match(line)
            if m:
                rows[m["func"]] = {"ncalls": float(m["ncalls"]), "tottime": float(m["tottime"]),
                                   "cumtime": float(m["cumtime"])}
            elif line.strip().startswith("==="):
                break
    return rows


def engine_steps(rows: dict[str, dict[str, float]]) -> int:
    """Engine steps of a run: calls of the scheduler's schedule()."""
    for func, row in rows.items():
        if STEP_FUNCTION in func and func.endswith(STEP_NAME):
            return int(row["ncalls"])
    raise ValueError("no scheduler.py(schedule) row: cannot count the engine steps")


def compare(base: dict, other: dict, top: int = 20) -> list[dict]:
    """Per-step own time (us) of every function in either profile, sorted by how much
    more ``other`` spends than ``base`` (largest first), ``top`` rows."""
    steps_a, steps_b = engine_steps(base), engine_steps(other)
    out = []
    for func in set(base) | set(other):
        a = base.get(func, {}).get("tottime", 0.0) / steps_a * 1e6
        b = other.get(func, {}).get("tottime", 0.0) / steps_b * 1e6
        out.append({"function": func, "base_us": round(a, 1), "other_us": round(b, 1),
                    "delta_us": round(b - a, 1)})
    out.sort(key=lambda r: -r["delta_us"])
    return out[:top]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="cProfile text of the reference engine (e.g. no-spec)")
    ap.add_argument("other", help="cProfile text of the engine to explain")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    with open(args.base) as f:
        base = parse_cprofile(f.read())
    with open(args.other) as f:
        other = parse_cprofile(f.read())
    try:
        rows = compare(base, other, args.top)
    except ValueError as exc:
        print(f"compare_profiles: {exc}", file=sys.stderr)
        return 1
    print(f"engine steps: base {engine_steps(base)}, other {engine_steps(other)}; "
          "own time per step, us")
    print(f"{'delta':>8} {'base':>8} {'other':>8}  function")
    for r in rows:
        print(f"{r['delta_us']:>8} {r['base_us']:>8} {r['other_us']:>8}  {r['function']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
