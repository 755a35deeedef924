"""bench/logits_rows.py: the row counts each pass of the GEMM benchmark runs (no GPU)."""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench.logits_rows import row_counts  # noqa: E402


def test_same_repeats_one_count():
    assert row_counts("same", 5, 16, 64) == [16] * 5


def test_new_counts_are_distinct_and_never_the_same_pass_count():
    counts = row_counts("new", 200, 16, 64)
    assert len(set(counts)) == 200 and 16 not in counts and min(counts) == 17


def test_bucket_rounds_each_new_count_up_to_a_multiple():
    new = row_counts("new", 100, 16, 64)
    bucket = row_counts("bucket", 100, 16, 64)
    assert all(b % 64 == 0 and n <= b < n + 64 for n, b in zip(new, bucket))
    assert set(bucket) == {64, 128}
