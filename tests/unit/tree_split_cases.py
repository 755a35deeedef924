"""Mixed verification batches for the route-2 tests (tests/unit/test_tree_attention_split.py,
tests/unit/test_tree_attention_flash.py): a paged KV cache holding this step's K/V,
per-request tree masks and the tree bias, and the dense references."""

from __future__ import annotations

import torch

from vllm_ddtree.tree_attention import allocate_tree_attn_bias, write_tree_attn_bias
from tests.references import reference_context_attention, reference_paged_attention
from tests.references import tree_ancestor_mask_reference

HQ, HKV, D, BLOCK, NODES = 4, 2, 16, 4, 6
SCALE = D**-0.5
PARENTS = [
    [-1, 0, 0, 1, 1, 2],
    [-1, 0, 1, 2, 3, 4],  # a chain
]


def make_batch(requests, seed=0, block=BLOCK, head_size=D, dtype=torch.float32):
    """requests: (context_len, query_len, parents or None). The cache already holds
    this step's K/V at positions context..context+query (written before attention).
    ``head_size`` other than D needs the scale ``head_size ** -0.5`` (``b["scale"]``)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks_per_req = max((c + q) // block + 1 for c, q, _ in requests)
    num_blocks = num_blocks_per_req * len(requests) + 1
    k_cache = torch.randn(num_blocks, block, HKV, head_size, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block, HKV, head_size, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    block_table = perm[: num_blocks_per_req * len(requests)].view(len(requests), -1).int()
    qsl = [0]
    for _, q, _ in requests:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1], HQ, head_size, generator=gen).to(dtype)
    keys, values, masks = [], [], []
    for s, (c, q, parents) in enumerate(requests):
        pos = torch.arange(c, c + q)
        blocks = block_table[s, pos // block].long()
        keys.append(k_cache[blocks, pos % block])
        values.append(v_cache[blocks, pos % block])
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
                seq_lens=[c + q for c, q, _ in requests], scale=head_size**-0.5)


def context_attention(b, poison_empty=True):
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


def dense_reference(b, causal_only=False):
    masks = [None] * len(b["masks"]) if causal_only else b["masks"]
    return reference_paged_attention(b["query"], b["k_cache"], b["v_cache"], b["block_table"],
                                     b["seq_lens"], b["qsl"], b["scale"], masks)
