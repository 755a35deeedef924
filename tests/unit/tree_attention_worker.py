"""Runs the PATCHED Triton unified attention on tree batches; prints errors as JSON.

Run as a subprocess by tests/unit/test_tree_attention.py, because Triton picks
interpreter or compiler when a kernel module is imported:

    CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 python tree_attention_worker.py cpu PATCH
    python tree_attention_worker.py cuda PATCH

The kernel source comes from the installed vLLM. If it is pristine, its
``triton_unified_attention.py`` and ``triton_attention_helpers.py`` are copied
to a temp folder, the patch is applied there (only those two files; ``git
apply``, else ``patch -p1``) and the copies are imported in place of the
installed ones (this process only). If the installed vLLM already carries the
patch (a patched image, or /opt/vllm-site after apply.sh), it is used as is.

For every case the JSON holds the largest absolute difference between the
kernel and the dense reference (``vllm_ddtree.tree_attention``) under the
right masks (``err``) and, where the case has trees, under plain causal masks
(``err_if_causal``: must be large, or the test could not fail).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from vllm_ddtree.tree_attention import allocate_tree_attn_bias, check_tree_parents, write_tree_attn_bias  # noqa: E402
from vllm_ddtree.tree_mask import tree_ancestor_mask  # noqa: E402
from tests.references import reference_context_attention, reference_paged_attention  # noqa: E402

OPS = "vllm/v1/attention/ops"
KERNEL = "triton_unified_attention.py"
HELPERS = "triton_attention_helpers.py"
PATCH_MARKER = "qq_bias_stride_req"


def load_patched_unified_attention(patch_path: str):
    """Return the patched ``triton_unified_attention`` module (see module doc)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("vLLM is not importable (set PYTHONPATH to its site folder)")
    installed = os.path.join(list(spec.submodule_search_locations)[0], "v1/attention/ops")
    with open(os.path.join(installed, KERNEL)) as f:
        if PATCH_MARKER in f.read():
            return importlib.import_module("vllm.v1.attention.ops.triton_unified_attention"), "installed (already patched)"

    tmp = tempfile.mkdtemp(prefix="ddtree-attn-")
    os.makedirs(os.path.join(tmp, OPS))
    for name in (KERNEL, HELPERS):
        shutil.copy(os.path.join(installed, name), os.path.join(tmp, OPS, name))
    includes = [f"{OPS}/{KERNEL}", f"{OPS}/{HELPERS}"]
    if shutil.which("git"):
        cmd = ["git", "apply", "-p1", *(f"--include={i}" for i in includes), os.path.abspath(patch_path)]
        res = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
    elif shutil.which("patch"):
        # `patch` has no --include: it would need every file of the patch.
        # Apply to a copy of the two files and ignore the backend hunks.
        res = _apply_with_patch_tool(tmp, patch_path, includes)
    else:
        raise RuntimeError("neither git nor patch is available to apply the patch")
    if res.returncode != 0:
        raise RuntimeError(f"applying {patch_path} to {installed} failed:\n{res.stdout}{res.stderr}")

    import vllm.v1.attention.ops  # noqa: F401  (parent package of the swapped modules)

    modules = {}
    for name in (HELPERS, KERNEL):  # helpers first: the kernel imports them by name
        mod_name = f"vllm.v1.attention.ops.{name[:-3]}"
        mspec = importlib.util.spec_from_file_location(mod_name, os.path.join(tmp, OPS, name))
        mod = importlib.util.module_from_spec(mspec)
        sys.modules[mod_name] = mod  # this worker process only
        mspec.loader.exec_module(mod)
        modules[name] = mod
    if PATCH_MARKER not in open(os.path.join(tmp, OPS, KERNEL)).read():
        raise RuntimeError("patch applied but the kernel lacks the per-request bias")
    return modules[KERNEL], f"pristine {installed} + patch in {tmp}"


def _apply_with_patch_tool(tmp: str, patch_path: str, includes: list[str]):
    text = open(patch_path).read()
    keep, chunks = [], text.split("\ndiff --git ")
    for chunk in chunks[1:]:
        if any(chunk.startswith(f"a/{i} ") for i in includes):
            keep.append("diff --git " + chunk)
    sub = os.path.join(tmp, "subset.patch")
    with open(sub, "w") as f:
        f.write("\n".join(keep) + "\n")
    return subprocess.run(
        ["patch", "-p1", "--no-backup-if-mismatch", "-i", sub],
        cwd=tmp, capture_output=True, text=True,
    )


# ---------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------

NUM_KV_HEADS = 2
NUM_Q_HEADS = 4  # GQA: 2 query heads per KV head
HEAD_SIZE = 32
BLOCK_SIZE = 16
TREE_NODES = 8  # B + 1


def random_tree(gen: torch.Generator, n: int, num_padding: int = 0) -> torch.Tensor:
    """Parents of a random tree of n nodes (parent < child); the last
    ``num_padding`` nodes are padding nodes (parent 0, agreed format)."""
    parents = [-1]
    for i in range(1, n):
        if i >= n - num_padding:
            parents.append(0)
        else:
            parents.append(int(torch.randint(0, i, (1,), generator=gen)))
    return torch.tensor(parents, dtype=torch.int32)


def build_batch(requests, gen, dtype):
    """requests: list of (context_len, query_len, parents or None).

    Returns a dict with the paged KV cache (NaN in every slot no sequence
    owns, so a read outside the mask poisons the result), random block
    tables, queries and the per-sequence tree masks."""
    num_seqs = len(requests)
    seq_lens = [c + q for c, q, _ in requests]
    blocks_per_seq = [(s + BLOCK_SIZE - 1) // BLOCK_SIZE for s in seq_lens]
    max_blocks = max(max(blocks_per_seq), 1) + 1
    num_blocks = sum(blocks_per_seq) + 7
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    k_cache = torch.full((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        block_table[s, :nb] = perm[used : used + nb]
        # Unused table entries point at real blocks of other sequences.
        block_table[s, nb:] = perm[torch.randint(0, num_blocks, (max_blocks - nb,), generator=gen)]
        used += nb
        pos = torch.arange(seq_lens[s])
        blk = block_table[s, pos // BLOCK_SIZE].long()
        k_cache[blk, pos % BLOCK_SIZE] = torch.randn(seq_lens[s], NUM_KV_HEADS, HEAD_SIZE, generator=gen)
        v_cache[blk, pos % BLOCK_SIZE] = torch.randn(seq_lens[s], NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    qsl = [0]
    for _, q, _ in requests:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1], NUM_Q_HEADS, HEAD_SIZE, generator=gen)
    tree_masks = []
    for _, q, parents in requests:
        if parents is None:
            tree_masks.append(None)
        else:
            check_tree_parents(parents[None])
            tree_masks.append(tree_ancestor_mask(parents[None])[0])
    return dict(
        query=query.to(dtype), k_cache=k_cache.to(dtype), v_cache=v_cache.to(dtype),
        block_table=block_table, seq_lens=seq_lens, query_start_loc=qsl,
        tree_masks=tree_masks, requests=requests,
    )


def run_kernel(ua, batch, device, bias, use_3d_buffers=False):
    q = batch["query"].to(device)
    k = batch["k_cache"].to(device)
    v = batch["v_cache"].to(device)
    out = torch.full_like(q, float("nan"))
    num_seqs = len(batch["seq_lens"])
    extra = {}
    if use_3d_buffers:
        segs = 16
        extra = dict(
            seq_threshold_3D=64,
            num_par_softmax_segments=segs,
            softmax_segm_output=torch.empty(q.shape[0], NUM_Q_HEADS, segs, HEAD_SIZE, device=device),
            softmax_segm_max=torch.empty(q.shape[0], NUM_Q_HEADS, segs, device=device),
            softmax_segm_expsum=torch.empty(q.shape[0], NUM_Q_HEADS, segs, device=device),
        )
    qlens = [b - a for a, b in zip(batch["query_start_loc"], batch["query_start_loc"][1:])]
    ones = torch.ones(num_seqs, NUM_KV_HEADS, device=device)
    ua.unified_attention(
        q=q, k=k, v=v, out=out,
        cu_seqlens_q=torch.tensor(batch["query_start_loc"], dtype=torch.int32, device=device),
        max_seqlen_q=max(qlens),
        seqused_k=torch.tensor(batch["seq_lens"], dtype=torch.int32, device=device),
        max_seqlen_k=max(batch["seq_lens"]),
        softmax_scale=HEAD_SIZE**-0.5,
        causal=True,
        window_size=(-1, -1),
        block_table=batch["block_table"].to(device),
        softcap=0,
        q_descale=None,
        k_descale=ones,
        v_descale=ones,
        qq_bias=bias,
        **extra,
    )
    return out.cpu()


def reference(batch, tree_masks):
    return reference_paged_attention(
        batch["query"].float(), batch["k_cache"].float(), batch["v_cache"].float(),
        batch["block_table"], batch["seq_lens"], batch["query_start_loc"],
        HEAD_SIZE**-0.5, tree_masks,
    )


def err(a, b):
    d = (a.float() - b.float()).abs()
    if torch.isnan(d).any():
        return float("inf")
    return float(d.max())


def tree_bias_for(batch, device, max_num_seqs=None):
    reqs = batch["requests"]
    n = max_num_seqs or len(reqs) + 3
    bias = allocate_tree_attn_bias(n, TREE_NODES, device)
    # Stale garbage in the rows beyond the batch must not matter.
    bias[len(reqs):] = float("-inf")
    parents = torch.stack([p if p is not None else torch.full((TREE_NODES,), -1, dtype=torch.int32)
                           for _, _, p in reqs])
    parents[:, 1:] = torch.where(parents[:, 1:] < 0, 0, parents[:, 1:])
    has_tree = torch.tensor([p is not None for _, _, p in reqs])
    write_tree_attn_bias(bias, parents.to(device), has_tree.to(device))
    # Rows of sequences with more than B+1 query tokens (prefills) are never
    # read by the kernel: poison them (all -inf would turn a wrongly biased row
    # into NaN). Shorter sequences without a tree keep the writer's zero row.
    for s, (_, qlen, _) in enumerate(reqs):
        if qlen > TREE_NODES:
            bias[s] = float("-inf")
    return bias


def main(device: str, patch_path: str) -> dict:
    ua, source = load_patched_unified_attention(patch_path)
    gen = torch.Generator().manual_seed(1234)
    results: dict = {"source": source, "device": device, "cases": {}}
    cases = results["cases"]

    tree_a = random_tree(gen, TREE_NODES)
    tree_b = random_tree(gen, TREE_NODES, num_padding=2)
    chain = torch.arange(-1, TREE_NODES - 1, dtype=torch.int32)
    star = torch.tensor([-1] + [0] * (TREE_NODES - 1), dtype=torch.int32)
    results["trees"] = [tree_a.tolist(), tree_b.tolist()]

    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        tag = str(dtype).removeprefix("torch.")
        # Mixed batch: trees not first; a prefill of 37 with context; a single
        # token; a prefill chunk of exactly B+1 tokens without a tree (zero bias).
        mixed = build_batch(
            [(50, TREE_NODES, tree_a), (10, 37, None), (40, 1, None),
             (23, TREE_NODES, tree_b), (5, TREE_NODES, None), (17, TREE_NODES, star)],
            gen, dtype,
        )
        out = run_kernel(ua, mixed, device, tree_bias_for(mixed, device))
        cases[f"mixed_tree_{tag}"] = dict(
            err=err(out, reference(mixed, mixed["tree_masks"])),
            err_if_causal=err(out, reference(mixed, [None] * len(mixed["requests"]))),
        )
        # The same batch without a bias / with an all-zero bias is causal.
        causal_ref = reference(mixed, [None] * len(mixed["requests"]))
        cases[f"no_bias_{tag}"] = dict(err=err(run_kernel(ua, mixed, device, None), causal_ref))
        zero = allocate_tree_attn_bias(len(mixed["requests"]), TREE_NODES, device)
        cases[f"zero_bias_{tag}"] = dict(err=err(run_kernel(ua, mixed, device, zero), causal_ref))

        # A full-graph-style decode batch: every request verifies a tree, plus
        # two padding sequences with no tokens (as CUDA-graph padding adds).
        uniform = build_batch(
            [(33, TREE_NODES, tree_b), (64, TREE_NODES, chain), (7, TREE_NODES, tree_a),
             (0, 0, None), (0, 0, None)],
            gen, dtype,
        )
        out = run_kernel(ua, uniform, device, tree_bias_for(uniform, device))
        live = uniform["query_start_loc"][-1]
        cases[f"uniform_trees_{tag}"] = dict(
            err=err(out[:live], reference(uniform, uniform["tree_masks"])[:live]),
            err_if_causal=err(out[:live], reference(uniform, [None] * 5)[:live]),
        )

        # Single-token decodes with the bias registered take the 3D
        # (split-softmax) path; the bias must not touch them.
        singles = build_batch([(70, 1, None), (3, 1, None), (129, 1, None)], gen, dtype)
        out = run_kernel(ua, singles, device, tree_bias_for(singles, device), use_3d_buffers=True)
        cases[f"decode_3d_{tag}"] = dict(err=err(out, reference(singles, [None] * 3)))

        # Route 2: context part (torch stand-in for FlashAttention) merged with the
        # tree tokens by the Triton kernel.
        live_reqs = [r for r in uniform["requests"] if r[1] > 0]
        cases[f"route2_tree_{tag}"] = run_route2(uniform, live_reqs, device)
    return results


def run_route2(batch, live_reqs, device):
    from vllm_ddtree.tree_attention_triton import merge_tree_suffix_attention

    num = len(live_reqs)
    qsl = batch["query_start_loc"][: num + 1]
    live = qsl[-1]
    ctx_lens = [c for c, _, _ in live_reqs]
    q = batch["query"][:live]
    ctx_out, ctx_lse = reference_context_attention(
        q.float(), batch["k_cache"].float(), batch["v_cache"].float(),
        batch["block_table"], ctx_lens, qsl, HEAD_SIZE**-0.5,
    )
    # The tree tokens' fresh K/V (what this forward writes to the cache).
    ks, vs = [], []
    for s, (c, n, _) in enumerate(live_reqs):
        pos = torch.arange(c, c + n)
        blk = batch["block_table"][s, pos // BLOCK_SIZE].long()
        ks.append(batch["k_cache"][blk, pos % BLOCK_SIZE])
        vs.append(batch["v_cache"][blk, pos % BLOCK_SIZE])
    k_new, v_new = torch.cat(ks), torch.cat(vs)
    bias = allocate_tree_attn_bias(num + 2, TREE_NODES, device)
    parents = torch.stack([p for _, _, p in live_reqs]).to(device)
    write_tree_attn_bias(bias, parents)
    merged = torch.empty_like(q).to(device)
    merge_tree_suffix_attention(
        merged, q.to(device), k_new.to(device), v_new.to(device),
        ctx_out.to(device).to(q.dtype), ctx_lse.to(device),
        torch.tensor(list(qsl), dtype=torch.int32, device=device),
        torch.tensor(ctx_lens, dtype=torch.int32, device=device), bias, HEAD_SIZE**-0.5,
    )
    merged = merged.cpu().float()
    want = reference(batch, batch["tree_masks"])[:live]
    causal = reference(batch, [None] * len(batch["requests"]))[:live]
    return dict(err=err(merged, want), err_if_causal=err(merged, causal))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("cpu", "cuda"):
        sys.exit("usage: tree_attention_worker.py {cpu|cuda} PATCH")
    if sys.argv[1] == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("the cpu run needs TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES= in the environment")
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])))
