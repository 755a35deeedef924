"""bench/topk_rounds.py: the selection in rounds it times against torch.topk picks what
torch.topk picks (CPU tensors, no GPU)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench.topk_rounds import topk_in_rounds  # noqa: E402


@pytest.mark.parametrize("vocab,chunk,k", [
    (4096, 1024, 64),   # slices only
    (5000, 1024, 8),    # slices and a remainder shorter than a slice
    (2100, 1024, 300),  # the remainder shorter than k: all of it enters
    (2047, 1024, 4),    # shorter than two slices: one torch.topk
    (4096, 64, 40),     # k over half a slice: one torch.topk
    (4096, 0, 16),      # rounds off
])
def test_topk_in_rounds_selects_what_torch_topk_selects(vocab, chunk, k):
    """topk_in_rounds picks the same entries as one torch.topk per row (distinct
    values, so the set is unique), on [R, D, V] logits and on a row-strided view of
    wider ones (a vocabulary padded by the logits processor)."""
    gen = torch.Generator().manual_seed(vocab + k)
    wide = torch.randn(3, 5, vocab + 32, generator=gen)
    for logits in (wide[..., :vocab].contiguous(), wide[..., :vocab]):
        vals, ids = topk_in_rounds(logits, k, chunk)
        want_vals, want_ids = torch.topk(logits, k, dim=-1)
        assert vals.shape == ids.shape == (3, 5, k)
        assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
        assert torch.equal(vals.sort(-1).values, want_vals.sort(-1).values)
        assert torch.equal(logits.gather(-1, ids), vals)


def test_topk_in_rounds_with_ties_keeps_a_real_top_k_set():
    """Ties at the k-th place (bf16 logits): any of the tied entries may enter, as with
    torch.topk, but the values selected are the k largest and the ids distinct."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 6, (4, 2, 3000), generator=gen).to(torch.bfloat16)
    vals, ids = topk_in_rounds(logits, 50, 256)
    want = torch.topk(logits.float(), 50, dim=-1).values
    assert torch.equal(vals.float().sort(-1).values, want.sort(-1).values)
    assert torch.equal(logits.gather(-1, ids), vals)
    assert all(len(set(row.tolist())) == 50 for row in ids.view(-1, 50))
