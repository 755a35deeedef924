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

from vllm_ddtree.tree_attention import (
    allocate_tree_attn_bias,
    reference_context_attention,
    reference_paged_attention,
    write_tree_attn_bias,
)
from vllm_ddtree.tree_mask import tree_ancestor_mask_reference

HQ, HKV, D, BLOCK, NODES = 4, 2, 16, 4, 6
SCALE = D**-0.5
PARENTS = [
    [-1, 0, 0, 1, 1, 2],
    [-1, 0, 1, 2, 3, 4],  # a chain
]


def _batch(requests, seed=0):
    """requests: (context_len, query_len, parents or None). The cache already holds
    this step's K/V at positions context..context+query (written before attention)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks_per_req = max((c + q) // BLOCK + 1 for c, q, _ in requests)
    num_blocks = num_blocks_per_req * len(requests) + 1
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, HKV, D, generator=gen)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    block_table = perm[: num_blocks_per_req * len(requests)].view(len(requests), -1).int()
    qsl = [0]
    for _, q, _ in requests:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1], HQ, D, generator=gen)
    keys, values, masks = [], [], []
    for s, (c, q, parents) in enumerate(requests):
        pos = torch.arange(c, c + q)
        blocks = block_table[s, pos // BLOCK].long()
        keys.append(k_cache[blocks, pos % BLOCK])
        values.append(v_cache[blocks, pos % BLOCK])
        masks.append(None if parents is None else
                     tree_ancestor_mask_reference(torch.tensor([parents[:q]]))[0])
    bias = allocate_tree_attn_bias(len(requests) + 2, NODES, torch.device("cpu"))
    bias[len(requests):] = float("-inf")  # rows past the batch are never read
    parents = torch.tensor([p if p is not None else [-1] + [0] * (NODES - 1)
                            for _, _, p in requests], dtype=torch.int32)
    has_tree = torch.tensor([p is not None for _, _, p in requests])
    write_tree_attn_bias(bias, parents, has_tree)
    return dict(query=query, key=torch.cat(keys), value=torch.cat(values), k_cache=k_cache,
                v_cache=v_cache, block_table=block_table, qsl=qsl, masks=masks, bias=bias,
                context_lens=[c for c, _, _ in requests],
                seq_lens=[c + q for c, q, _ in requests])


def _context(b, poison_empty=True):
    out, lse = reference_context_attention(b["query"], b["k_cache"], b["v_cache"],
                                           b["block_table"], b["context_lens"], b["qsl"], SCALE)
    if poison_empty:
        # What a FlashAttention call leaves for a request without context: undefined
        # rows (NaN here) and an LSE that may be +inf (FA2) or -inf (FA3).
        for s, c in enumerate(b["context_lens"]):
            if c == 0:
                out[b["qsl"][s]: b["qsl"][s + 1]] = float("nan")
                lse[:, b["qsl"][s]: b["qsl"][s + 1]] = float("inf")
    return out, lse


def _reference(b, causal_only=False):
    masks = [None] * len(b["masks"]) if causal_only else b["masks"]
    return reference_paged_attention(b["query"], b["k_cache"], b["v_cache"], b["block_table"],
                                     b["seq_lens"], b["qsl"], SCALE, masks)


def _run(b, device, plain_calls):
    from vllm_ddtree.tree_attention_triton import split_tree_attention

    def plain(out):
        plain_calls.append(1)
        out.copy_(_reference(b, causal_only=True).to(device))

    output = torch.full_like(b["query"], float("nan")).to(device)
    q_lens = [b["qsl"][i + 1] - b["qsl"][i] for i in range(len(b["qsl"]) - 1)]
    return split_tree_attention(
        output, b["query"].to(device), b["key"].to(device), b["value"].to(device),
        max(q_lens), torch.tensor(b["qsl"], dtype=torch.int32, device=device),
        torch.tensor(b["context_lens"], dtype=torch.int32, device=device),
        b["bias"].to(device), SCALE, plain,
        lambda: tuple(t.to(device) for t in _context(b)),
    ).cpu()


@pytest.mark.parametrize("seed", range(2))
def test_trees_decodes_and_a_fresh_prefill_without_the_plain_call(triton_device, seed):
    requests = [(9, NODES, PARENTS[0]), (3, 1, None), (0, 3, None), (13, NODES, PARENTS[1]),
                (5, 4, PARENTS[0])]  # a scheduled budget below the tree's: a prefix
    b = _batch(requests, seed)
    calls = []
    out = _run(b, triton_device, calls)
    assert calls == [], "every request fits a tree: no plain call"
    assert torch.allclose(out, _reference(b), atol=2e-4), (out - _reference(b)).abs().max()
    # Guard: the trees differ from causal enough to fail a kernel that ignores them.
    assert (out - _reference(b, causal_only=True)).abs().max() > 0.1


def test_a_long_prefill_chunk_keeps_the_plain_calls_rows(triton_device):
    requests = [(9, NODES, PARENTS[1]), (4, NODES + 5, None), (6, 1, None)]
    b = _batch(requests, 3)
    calls = []
    out = _run(b, triton_device, calls)
    assert calls == [1]
    assert torch.allclose(out, _reference(b), atol=2e-4), (out - _reference(b)).abs().max()


def test_one_token_per_request_is_the_plain_call_alone(triton_device):
    b = _batch([(5, 1, None), (8, 1, None)], 4)
    calls = []

    def no_context():
        raise AssertionError("no context call without a tree")

    from vllm_ddtree.tree_attention_triton import split_tree_attention

    output = torch.zeros_like(b["query"])
    split_tree_attention(output, b["query"], b["key"], b["value"], 1,
                         torch.tensor(b["qsl"], dtype=torch.int32),
                         torch.tensor(b["context_lens"], dtype=torch.int32), b["bias"], SCALE,
                         lambda out: calls.append(out.copy_(_reference(b, causal_only=True))),
                         no_context)
    assert len(calls) == 1 and torch.allclose(output, _reference(b), atol=1e-5)


def test_bad_shapes_are_refused():
    from vllm_ddtree.tree_attention_triton import merge_tree_suffix_attention

    b = _batch([(5, 2, None)], 5)
    qsl = torch.tensor(b["qsl"], dtype=torch.int32)
    ctx = torch.tensor(b["context_lens"], dtype=torch.int32)
    out, lse = _context(b, poison_empty=False)
    with pytest.raises(ValueError, match="ctx_lse"):
        merge_tree_suffix_attention(torch.empty_like(out), b["query"], b["key"], b["value"],
                                    out, lse.t().contiguous(), qsl, ctx, b["bias"], SCALE)
    with pytest.raises(ValueError, match="tree_bias"):
        merge_tree_suffix_attention(torch.empty_like(out), b["query"], b["key"], b["value"],
                                    out, lse, qsl, ctx, b["bias"].double(), SCALE)
    with pytest.raises(ValueError, match="KV heads"):
        merge_tree_suffix_attention(torch.empty_like(out), b["query"][:, :3], b["key"],
                                    b["value"], out[:, :3], lse[:3], qsl, ctx, b["bias"], SCALE)
