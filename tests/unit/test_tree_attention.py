"""Tree attention: the per-request bias patch for Triton unified attention.

The kernel tests run tests/unit/tree_attention_worker.py in a subprocess
(Triton chooses interpreter or compiler when the kernel module is imported):
on the CPU under the Triton interpreter always, on CUDA when a GPU is present.
They compare the PATCHED kernel with the dense reference in
vllm_ddtree.tree_attention on mixed batches (a 37-token prefill, tree decodes
of B+1 = 8 nodes with different trees, a single-token decode, an 8-token
prefill chunk without a tree), paged KV with block size 16, random block
tables, GQA 2:1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.tree_attention import allocate_tree_attn_bias, check_tree_parents, register_tree_attn_bias, write_tree_attn_bias
from vllm_ddtree.tree_mask import tree_ancestor_mask
from tests.references import reference_paged_attention

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCH = os.path.join(ROOT, "patches", "attention_triton-per-request-tree-bias.patch")
WORKER = os.path.join(ROOT, "tests", "unit", "tree_attention_worker.py")


def random_parents(gen: torch.Generator, num_reqs: int, n: int) -> torch.Tensor:
    parents = torch.full((num_reqs, n), -1, dtype=torch.int32)
    for r in range(num_reqs):
        for i in range(1, n):
            parents[r, i] = int(torch.randint(0, i, (1,), generator=gen))
    return parents


def naive_ancestors(parents: torch.Tensor) -> torch.Tensor:
    num_reqs, n = parents.shape
    mask = torch.zeros(num_reqs, n, n, dtype=torch.bool)
    for r in range(num_reqs):
        for i in range(n):
            j = i
            while j >= 0:
                mask[r, i, j] = True
                j = int(parents[r, j])
    return mask


# ---------------------------------------------------------------------------
# Pure-torch helpers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 8, 17, 65])
def test_ancestor_mask_matches_walk(n):
    gen = torch.Generator().manual_seed(n)
    parents = random_parents(gen, 5, n)
    chain = torch.arange(-1, n - 1, dtype=torch.int32)[None]
    parents = torch.cat([parents, chain])
    check_tree_parents(parents)
    assert torch.equal(tree_ancestor_mask(parents), naive_ancestors(parents))


def test_ancestor_mask_padding_nodes_see_root_and_self():
    parents = torch.tensor([[-1, 0, 1, 0, 0]], dtype=torch.int32)  # nodes 3, 4: padding
    mask = tree_ancestor_mask(parents)[0]
    assert mask[3].tolist() == [True, False, False, True, False]
    assert mask[4].tolist() == [True, False, False, False, True]


@pytest.mark.parametrize(
    "parents, message",
    [
        ([[0, 0, 1]], r"node_parents\[0, 0\] must be -1"),
        ([[-1, 0, 2]], r"node_parents\[0, 2\] = 2"),
        ([[-1, -1, 0]], r"node_parents\[0, 1\] = -1"),
        ([[-1, 0, 5]], r"node_parents\[0, 2\] = 5"),
    ],
)
def test_check_tree_parents_names_the_bad_node(parents, message):
    with pytest.raises(ValueError, match=message):
        check_tree_parents(torch.tensor(parents))


def test_write_bias_in_place_and_zero_rows_without_tree():
    gen = torch.Generator().manual_seed(0)
    parents = random_parents(gen, 3, 8)
    bias = allocate_tree_attn_bias(6, 8, "cpu")
    bias[3:] = 7.0  # rows past the batch are left alone
    ptr = bias.data_ptr()
    out = write_tree_attn_bias(bias, parents, torch.tensor([True, False, True]))
    assert bias.data_ptr() == ptr and out.data_ptr() == ptr
    expected = torch.where(naive_ancestors(parents), 0.0, float("-inf"))
    assert torch.equal(bias[0], expected[0]) and torch.equal(bias[2], expected[2])
    assert torch.equal(bias[1], torch.zeros(8, 8))
    assert torch.equal(bias[3:], torch.full((3, 8, 8), 7.0))


def test_write_bias_rejects_bad_input():
    bias = allocate_tree_attn_bias(2, 8, "cpu")
    with pytest.raises(ValueError, match=r"node_parents must be \[num_reqs, 8\]"):
        write_tree_attn_bias(bias, torch.full((2, 5), -1))
    with pytest.raises(ValueError, match="do not fit"):
        write_tree_attn_bias(bias, torch.zeros(3, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="float32"):
        write_tree_attn_bias(bias.half(), torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="has_tree must be bool"):
        write_tree_attn_bias(bias, torch.zeros(2, 8, dtype=torch.int32), torch.ones(2))
    with pytest.raises(ValueError, match="must be >= 1"):
        allocate_tree_attn_bias(0, 8, "cpu")


class _FakeBackend:
    def __init__(self, name):
        self.name = name

    def get_name(self):
        return self.name


def test_register_sets_every_target_builder_and_refuses_other_backends():
    bias = allocate_tree_attn_bias(4, 8, "cpu")
    builders = [SimpleNamespace(tree_attn_bias=None) for _ in range(3)]
    groups = [
        [SimpleNamespace(backend=_FakeBackend("TRITON_ATTN"), layer_names=["l0"], metadata_builders=builders[:2])],
        [SimpleNamespace(backend=_FakeBackend("TRITON_ATTN"), layer_names=["l1"], metadata_builders=builders[2:])],
    ]
    assert register_tree_attn_bias(groups, bias) == 3
    assert all(b.tree_attn_bias is bias for b in builders)
    # FLASH_ATTN's patched builders take the bias too (the opt-in tree split).
    fa_builder = SimpleNamespace(tree_attn_bias=None)
    fa = [SimpleNamespace(backend=_FakeBackend("FLASH_ATTN"), layer_names=["l0"],
                          metadata_builders=[fa_builder])]
    assert register_tree_attn_bias(fa, bias) == 1 and fa_builder.tree_attn_bias is bias
    flashinfer = [SimpleNamespace(backend=_FakeBackend("FLASHINFER"), layer_names=["l0"],
                                  metadata_builders=[])]
    with pytest.raises(ValueError, match="needs attention backend TRITON_ATTN"):
        register_tree_attn_bias(flashinfer, bias)
    unpatched = [SimpleNamespace(backend=_FakeBackend("TRITON_ATTN"), layer_names=["l0"], metadata_builders=[object()])]
    with pytest.raises(RuntimeError, match="lacks the tree_attn_bias hook"):
        register_tree_attn_bias(unpatched, bias)
    unpatched_fa = [SimpleNamespace(backend=_FakeBackend("FLASH_ATTN"), layer_names=["l0"],
                                    metadata_builders=[object()])]
    with pytest.raises(RuntimeError, match="attention_flash-attn-tree-split"):
        register_tree_attn_bias(unpatched_fa, bias)


def _triton_builder(tree_bias):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

    builder = TritonAttentionMetadataBuilder.__new__(TritonAttentionMetadataBuilder)
    builder.__dict__.update(
        device=torch.device("cpu"), seq_threshold_3D=8, num_par_softmax_segments=4,
        softmax_segm_output=None, softmax_segm_max=None, softmax_segm_expsum=None,
        rswa_window=None, tree_attn_bias=tree_bias,
        max_seqs_64_segments=0)  # 0.33.0's 64-segment decode layout: off
    return builder


def _triton_common_metadata(q_lens, seq_lens):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(q_lens),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.zeros(len(q_lens), 4, dtype=torch.int32),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64))


def test_the_triton_builder_passes_the_bias_only_to_steps_with_trees():
    """The patched build(): a step with more than one query token for some request
    carries the registered bias (zero rows for requests without a tree); a step with
    one token per request (plain decodes, drafting-off steps) carries none, so it runs
    the kernel variant vLLM runs without speculation."""
    pytest.importorskip("vllm")
    bias = allocate_tree_attn_bias(4, 8, "cpu")
    builder = _triton_builder(bias)
    assert builder.build(0, _triton_common_metadata([8, 1, 3], [20, 9, 3])).tree_attn_bias is bias
    assert builder.build(0, _triton_common_metadata([1, 1, 1], [20, 9, 3])).tree_attn_bias is None
    assert builder.build(0, _triton_common_metadata([1], [5])).tree_attn_bias is None
    # Without a registered bias (the drafter's builders, plain TRITON_ATTN): none ever.
    assert _triton_builder(None).build(0, _triton_common_metadata([8, 1], [20, 9])).tree_attn_bias is None


def test_every_captured_full_graph_reads_the_bias():
    """build_for_cudagraph_capture(): a FULL graph captured with one query token per
    request (vLLM's mixed graphs up to max_num_seqs tokens are) is also replayed for
    mixed batches of that token count, trees included, so its metadata carries the
    bias too; without it, a tree verified in such a graph would attend its siblings."""
    pytest.importorskip("vllm")
    bias = allocate_tree_attn_bias(4, 8, "cpu")
    builder = _triton_builder(bias)
    for q_lens in ([1, 1, 1], [1], [4, 4]):
        meta = builder.build_for_cudagraph_capture(_triton_common_metadata(q_lens, [5] * len(q_lens)))
        assert meta.tree_attn_bias is bias
    assert _triton_builder(None).build_for_cudagraph_capture(
        _triton_common_metadata([1, 1], [5, 5])).tree_attn_bias is None


def test_reference_causal_matches_sdpa():
    """The reference itself, against torch SDPA on contiguous KV."""
    gen = torch.Generator().manual_seed(3)
    block_size, hkv, hq, d = 4, 2, 4, 8
    seq_lens, qlens = [11, 6], [5, 1]
    num_blocks = 8
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    block_table = torch.tensor([[5, 0, 7], [2, 6, 1]], dtype=torch.int32)
    qsl = [0, 5, 6]
    query = torch.randn(6, hq, d, generator=gen)
    out = reference_paged_attention(query, k_cache, v_cache, block_table, seq_lens, qsl, d**-0.5, [None, None])
    for s in range(2):
        pos = torch.arange(seq_lens[s])
        blk = block_table[s, pos // block_size].long()
        k = k_cache[blk, pos % block_size].repeat_interleave(2, 1).transpose(0, 1)
        v = v_cache[blk, pos % block_size].repeat_interleave(2, 1).transpose(0, 1)
        q = query[qsl[s] : qsl[s + 1]].transpose(0, 1)
        ctx = seq_lens[s] - qlens[s]
        mask = torch.arange(seq_lens[s])[None, :] <= (ctx + torch.arange(qlens[s]))[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[qsl[s] : qsl[s + 1]], want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------
# The patch file
# ---------------------------------------------------------------------------


def test_patch_header_and_paths():
    text = open(PATCH).read()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    for trailer in ("Upstream-Status: Inappropriate [", "Drop-When: ", "Tested-By: tests/unit/test_tree_attention.py"):
        assert trailer in text, trailer
    paths = re.findall(r"^diff --git a/(\S+) b/(\S+)$", text, re.M)
    assert paths and all(a == b and a.startswith("vllm/") for a, b in paths)
    assert {a for a, _ in paths} == {
        "vllm/v1/attention/backends/triton_attn.py",
        "vllm/v1/attention/ops/triton_unified_attention.py",
        "vllm/v1/attention/ops/triton_attention_helpers.py",
    }


# ---------------------------------------------------------------------------
# The patched kernel (subprocess per device)
# ---------------------------------------------------------------------------

DEVICES = [
    "cpu-interpreter",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]

# fp32 on CUDA: tl.dot uses TF32; bf16: bf16 inputs and output.
TOLERANCE = {"cpu": {"float32": 1e-4}, "cuda": {"float32": 2e-2, "bfloat16": 6e-2}}


@pytest.fixture(scope="module", params=DEVICES)
def kernel_results(request):
    pytest.importorskip("vllm")
    pytest.importorskip("triton")
    device = "cpu" if request.param == "cpu-interpreter" else "cuda"
    env = dict(os.environ)
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, WORKER, device, PATCH],
        capture_output=True, text=True, env=env, timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _cases(results, prefix):
    found = {k: v for k, v in results["cases"].items() if k.startswith(prefix)}
    assert found, f"no {prefix}* case in {sorted(results['cases'])}"
    return found


def _tol(results, name):
    return TOLERANCE[results["device"]][name.rsplit("_", 1)[1]]


@pytest.mark.parametrize("prefix", ["mixed_tree", "uniform_trees", "route2_tree"])
def test_kernel_matches_tree_reference(kernel_results, prefix):
    for name, case in _cases(kernel_results, prefix).items():
        assert case["err"] <= _tol(kernel_results, name), (name, case, kernel_results["source"])


@pytest.mark.parametrize("prefix", ["mixed_tree", "uniform_trees", "route2_tree"])
def test_causal_mask_would_fail_the_comparison(kernel_results, prefix):
    """Guard: the trees differ from causal enough that a kernel ignoring the
    bias (or a reference using the wrong mask) fails the check above."""
    for name, case in _cases(kernel_results, prefix).items():
        tol = _tol(kernel_results, name)
        assert case["err_if_causal"] > max(0.1, 5 * tol), (name, case)


@pytest.mark.parametrize("prefix", ["no_bias", "zero_bias", "decode_3d"])
def test_kernel_without_tree_is_causal(kernel_results, prefix):
    for name, case in _cases(kernel_results, prefix).items():
        assert case["err"] <= _tol(kernel_results, name), (name, case)
