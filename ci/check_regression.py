#!/usr/bin/env python3
"""Compare a benchmark result file against the committed baseline and fail on regressions.

Both files use the benchmark result format described in ci/README.md:

    {"git_rev": "...", "command": "...",
     "results": [{"config": "ddtree-b32", "prompt_set": "humaneval", "batch_size": 1,
                  "temperature": 0.0, "tau": 3.1, "output_tokens_per_s": 812.5,
                  "greedy_match": true}, ...]}

An entry is identified by (config, prompt_set, batch_size, temperature). For every
baseline entry the current file must hold the same entry, and:

* ``greedy_match`` must be true wherever the baseline or the current entry has it;
* ``tau`` (mean accepted tokens per step) must be >= baseline * (1 - tau_tolerance)
  wherever the baseline has it;
* ``output_tokens_per_s`` must be >= baseline * (1 - tps_tolerance).

Exit status: 0 when every check passes, 1 when any fails, 2 when an input is unusable
(unreadable, not JSON, or not in the format above).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXIT_PASS = 0
EXIT_REGRESSION = 1
EXIT_BAD_INPUT = 2

KEY_FIELDS = ("config", "prompt_set", "batch_size", "temperature")

Key = tuple[str, str, int, float]


class InputError(Exception):
    """A result file that cannot be compared; the message names the file and the entry."""


@dataclass(frozen=True)
class Entry:
    key: Key
    tau: float | None
    output_tokens_per_s: float
    greedy_match: bool | None


@dataclass(frozen=True)
class Check:
    key: Key
    metric: str
    baseline: str
    current: str
    limit: str
    ok: bool
    note: str = ""


def _number(value: Any, where: str, field: str, *, required: bool) -> float | None:
    if value is None:
        if required:
            raise InputError(f"{where}: '{field}' is required")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{where}: '{field}' must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise InputError(f"{where}: '{field}' must be a finite number >= 0, got {value!r}")
    return float(value)


def _parse_entry(raw: Any, where: str) -> Entry:
    if not isinstance(raw, dict):
        raise InputError(f"{where}: each result must be a JSON object, got {type(raw).__name__}")
    for field in ("config", "prompt_set"):
        if not isinstance(raw.get(field), str) or not raw[field]:
            raise InputError(f"{where}: '{field}' must be a non-empty string, got {raw.get(field)!r}")
    batch_size = raw.get("batch_size")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"{where}: 'batch_size' must be an integer >= 1, got {batch_size!r}")
    temperature = _number(raw.get("temperature"), where, "temperature", required=True)
    greedy_match = raw.get("greedy_match")
    if greedy_match is not None and not isinstance(greedy_match, bool):
        raise InputError(f"{where}: 'greedy_match' must be true or false, got {greedy_match!r}")
    tps = _number(raw.get("output_tokens_per_s"), where, "output_tokens_per_s", required=True)
    assert tps is not None
    return Entry(
        key=(raw["config"], raw["prompt_set"], batch_size, temperature),  # type: ignore[arg-type]
        tau=_number(raw.get("tau"), where, "tau", required=False),
        output_tokens_per_s=tps,
        greedy_match=greedy_match,
    )


def load_results(path: Path) -> dict[Key, Entry]:
    """Read one result file; raise InputError naming the problem."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise InputError(f"{path}: expected a JSON object with a 'results' list")
    if not doc["results"]:
        raise InputError(f"{path}: 'results' is empty")
    entries: dict[Key, Entry] = {}
    for index, raw in enumerate(doc["results"]):
        entry = _parse_entry(raw, f"{path}: results[{index}]")
        if entry.key in entries:
            raise InputError(f"{path}: results[{index}]: duplicate entry {format_key(entry.key)}")
        entries[entry.key] = entry
    return entries


def format_key(key: Key) -> str:
    config, prompt_set, batch_size, temperature = key
    return f"{config}/{prompt_set}/bs{batch_size}/T{temperature:g}"


def _minimum_check(key: Key, metric: str, base: float, cur: float | None, tol: float) -> Check:
    limit = base * (1.0 - tol)
    if cur is None:
        return Check(key, metric, f"{base:.3f}", "-", f">= {limit:.3f}", False, "missing in current")
    change = (cur - base) / base * 100.0 if base > 0 else 0.0
    return Check(key, metric, f"{base:.3f}", f"{cur:.3f}", f">= {limit:.3f}", cur >= limit, f"{change:+.1f}%")


def compare(
    baseline: dict[Key, Entry],
    current: dict[Key, Entry],
    tau_tolerance: float,
    tps_tolerance: float,
) -> list[Check]:
    """All checks of current against baseline, in baseline order."""
    checks: list[Check] = []
    for key, base in baseline.items():
        cur = current.get(key)
        if cur is None:
            checks.append(Check(key, "entry", "present", "missing", "present", False, "no current result"))
            continue
        if base.greedy_match is not None or cur.greedy_match is not None:
            checks.append(_greedy_check(key, base.greedy_match, cur.greedy_match))
        if base.tau is not None:
            checks.append(_minimum_check(key, "tau", base.tau, cur.tau, tau_tolerance))
        checks.append(
            _minimum_check(
                key, "output_tokens_per_s", base.output_tokens_per_s, cur.output_tokens_per_s, tps_tolerance
            )
        )
    return checks


def _greedy_check(key: Key, base: bool | None, cur: bool | None) -> Check:
    """greedy_match must be true: a lossless method never changes greedy output."""
    return Check(
        key,
        "greedy_match",
        "-" if base is None else str(base).lower(),
        "missing" if cur is None else str(cur).lower(),
        "true",
        cur is True,
        "outputs differ from the target's" if cur is False else "",
    )


def greedy_checks(entries: dict[Key, Entry]) -> list[Check]:
    """greedy_match must be true wherever an entry reports it, baseline or not."""
    return [_greedy_check(key, None, e.greedy_match) for key, e in entries.items()
            if e.greedy_match is not None]


def render_table(checks: list[Check]) -> str:
    header = ("entry", "metric", "baseline", "current", "limit", "status", "note")
    rows = [header] + [
        (format_key(c.key), c.metric, c.baseline, c.current, c.limit, "ok" if c.ok else "FAIL", c.note)
        for c in checks
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="committed baseline result file")
    parser.add_argument("--current", type=Path, required=True, help="result file of this run")
    parser.add_argument("--tau-tolerance", type=_tolerance, default=0.05,
                        help="allowed relative drop of tau below the baseline (default 0.05)")
    parser.add_argument("--tps-tolerance", type=_tolerance, default=0.10,
                        help="allowed relative drop of output tokens/s below the baseline (default 0.10)")
    parser.add_argument("--allow-missing-baseline", action="store_true",
                        help="without a baseline file, check greedy equivalence only (exit 0 if it holds)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, which matches EXIT_BAD_INPUT
        return int(exc.code or 0)

    try:
        current = load_results(args.current)
        if args.allow_missing_baseline and not args.baseline.exists():
            print(f"check_regression: no baseline at {args.baseline}: only greedy equivalence is "
                  "checked; commit this run's result there to gate tau and tokens/s",
                  file=sys.stderr)
            baseline = {}
        else:
            baseline = load_results(args.baseline)
    except InputError as exc:
        print(f"check_regression: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT

    checks = compare(baseline, current, args.tau_tolerance, args.tps_tolerance)
    extra = [key for key in current if key not in baseline]
    # Losslessness needs no baseline: a greedy mismatch fails wherever it appears.
    checks += greedy_checks({k: current[k] for k in extra})
    print(render_table(checks) if checks else "(no checks)")
    if extra:
        print(f"\n{len(extra)} current entr{'y' if len(extra) == 1 else 'ies'} without a baseline "
              f"(tau and tokens/s not checked): {', '.join(format_key(k) for k in extra)}")
    failures = [c for c in checks if not c.ok]
    print()
    if failures:
        print(f"FAIL: {len(failures)} of {len(checks)} checks failed "
              f"(tau tolerance {args.tau_tolerance:g}, tokens/s tolerance {args.tps_tolerance:g})")
        return EXIT_REGRESSION
    print(f"PASS: {len(checks)} checks over {len(baseline)} baseline entries and {len(extra)} others "
          f"(tau tolerance {args.tau_tolerance:g}, tokens/s tolerance {args.tps_tolerance:g})")
    return EXIT_PASS


if __name__ == "__main__":
    sys.exit(main())
