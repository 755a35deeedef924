"""Route 2 of docs/tree-attention.md on mixed batches: context attention (a stand-in
for FlashAttention's non-causal call over the cache) merged with the tree-suffix
kernel, against the dense reference with each request's mask.

The batch mixes what a serving step can hold: requests verifying trees, one-token
decodes, a short first prefill chunk (no context: the context part is undefined and
must weigh nothing) and, in one case, a prefill chunk longer than a tree (handled by
the backend's plain call). Triton runs in its interpreter on a CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.tree_split_cases import (
    NODES,
    PARENTS,
    SCALE,
    context_attention,
    dense_reference,
    make_batch,
)

def _run(b, device, plain_calls):
    from vllm_ddtree.tree_attention_triton import split_tree_attention

    def plain(out):
        plain_calls.append(1)
        out.copy_(dense_reference(b, causal_only=True).to(device))

    output = torch.full_like(b["query"], float("nan")).to(device)
    q_lens = [b["qsl"][i + 1] - b["qsl"][i] for i in range(len(b["qsl"]) - 1)]
    return split_tree_attention(
        output, b["query"].to(device), b["key"].to(device), b["value"].to(device),
        max(q_lens), torch.tensor(b["qsl"], dtype=torch.int32, device=device),
        torch.tensor(b["context_lens"], dtype=torch.int32, device=device),
        b["bias"].to(device), SCALE, plain,
        lambda: tuple(t.to(device) for t in context_attention(b)),
    ).cpu()


@pytest.mark.parametrize("seed", range(2))
def test_trees_decodes_and_a_fresh_prefill_without_the_plain_call(triton_device, seed):
    requests = [(9, NODES, PARENTS[0]), (3, 1, None), (0, 3, None), (13, NODES, PARENTS[1]),
                (5, 4, PARENTS[0])]  # a scheduled budget below the tree's: a prefix
    b = make_batch(requests, seed)
    calls = []
    out = _run(b, triton_device, calls)
    assert calls == [], "every request fits a tree: no plain call"
    assert torch.allclose(out, dense_reference(b), atol=2e-4), (out - dense_reference(b)).abs().max()
    # Guard: the trees differ from causal enough to fail a kernel that ignores them.
    assert (out - dense_reference(b, causal_only=True)).abs().max() > 0.1


def test_a_long_prefill_chunk_keeps_the_plain_calls_rows(triton_device):
    requests = [(9, NODES, PARENTS[1]), (4, NODES + 5, None), (6, 1, None)]
    b = make_batch(requests, 3)
    calls = []
    out = _run(b, triton_device, calls)
    assert calls == [1]
    assert torch.allclose(out, dense_reference(b), atol=2e-4), (out - dense_reference(b)).abs().max()


def test_one_token_per_request_is_the_plain_call_alone(triton_device):
    b = make_batch([(5, 1, None), (8, 1, None)], 4)
    calls = []

    def no_context():
        raise AssertionError("no context call without a tree")

    from vllm_ddtree.tree_attention_triton import split_tree_attention

    output = torch.zeros_like(b["query"])
    split_tree_attention(output, b["query"], b["key"], b["value"], 1,
                         torch.tensor(b["qsl"], dtype=torch.int32),
                         torch.tensor(b["context_lens"], dtype=torch.int32), b["bias"], SCALE,
                         lambda out: calls.append(out.copy_(dense_reference(b, causal_only=True))),
                         no_context)
    assert len(calls) == 1 and torch.allclose(output, dense_reference(b), atol=1e-5)


def test_bad_shapes_are_refused():
    from vllm_ddtree.tree_attention_triton import merge_tree_suffix_attention

    b = make_batch([(5, 2, None)], 5)
    qsl = torch.tensor(b["qsl"], dtype=torch.int32)
    ctx = torch.tensor(b["context_lens"], dtype=torch.int32)
    out, lse = context_attention(b, poison_empty=False)
    with pytest.raises(ValueError, match="ctx_lse"):
        merge_tree_suffix_attention(torch.empty_like(out), b["query"], b["key"], b["value"],
                                    out, lse.t().contiguous(), qsl, ctx, b["bias"], SCALE)
    with pytest.raises(ValueError, match="tree_bias"):
        merge_tree_suffix_attention(torch.empty_like(out), b["query"], b["key"], b["value"],
                                    out, lse, qsl, ctx, b["bias"].double(), SCALE)
    with pytest.raises(ValueError, match="KV heads"):
        merge_tree_suffix_attention(torch.empty_like(out), b["query"][:, :3], b["key"],
                                    b["value"], out[:, :3], lse[:3], qsl, ctx, b["bias"], SCALE)
