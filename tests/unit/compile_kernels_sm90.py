"""Compile the project's Triton kernels for sm_90 (H200) without a GPU and report
ptxas register/spill figures. Run as a script (Triton must NOT be in interpreter mode):

    CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=0 python tests/unit/compile_kernels_sm90.py

Prints one JSON line per compiled variant; exits non-zero on any failure or spill.
Used by test_kernels_compile.py; catches compiler-only errors the interpreter accepts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vllm_ddtree.kv_compaction import _compact_kv_kernel, _compact_path_kernel, tile_width  # noqa: E402
from vllm_ddtree.tree_attention import (  # noqa: E402
    _tree_attn_bias_kernel,
    tree_attn_bias_launch_config,
)
from vllm_ddtree.tree_builder import (  # noqa: E402
    _build_tree_kernel,
    _logsumexp_kernel,
    _store_by_state_kernel,
)
from vllm_ddtree.tree_mask import REWRITE_POSITIONS_BLOCK, _rewrite_positions_kernel  # noqa: E402
from vllm_ddtree.tree_walk import _walk_fused_kernel  # noqa: E402

TREE_SIG = {
    "topk_ids_ptr": "*i64", "topk_logp_ptr": "*fp32", "root_tokens_ptr": "*i64",
    "tokens_ptr": "*i64", "parents_ptr": "*i32", "depths_ptr": "*i32", "valid_ptr": "*i1",
    "scores_ptr": "*fp32", "max_depth": "i32", "k": "i32", "budget": "i32",
    "row_nodes": "i32", "HAS_ROOT": "constexpr", "BLOCK": "constexpr", "PAD_BLOCK": "constexpr",
}
KV_SIG = {
    "kv_ptr": None, "src_ptr": "*i64", "dst_ptr": "*i64", "num_moves": "i32",
    "block_size": "i32", "stride_block": "i64", "stride_token": "i64", "size1": "i32",
    "size2": "i32", "stride0": "i64", "stride1": "i64", "stride2": "i64",
    "inner_numel": "i32", "BLOCK_M": "constexpr", "BLOCK_E": "constexpr",
}

PATH_SIG = {
    "kv_ptr": None, "kv_off_ptr": "*i64", "hid_ptr": "*i64", "acc_ptr": "*i64", "acc_stride": "i64",
    "num_acc_ptr": "*i64", "qsl_ptr": "*i32", "slot_ptr": "*i64", "num_slots": "i32",
    "num_hid_rows": "i32", "width": "i32", "num_layers": "i32", "kv_chunks": "i32",
    "block_size": "i32", "stride_block": "i64", "stride_token": "i64", "size1": "i32",
    "size2": "i32", "stride0": "i64", "stride1": "i64", "stride2": "i64", "kv_inner": "i32",
    "hid_row_stride": "i64", "hid_inner": "i32", "pos_ptr": "*i64", "pos_pid": "i32",
    "HAS_KV": "constexpr", "HAS_HIDDEN": "constexpr", "HAS_POS": "constexpr",
    "BLOCK_M": "constexpr", "BLOCK_E": "constexpr",
}
STORE_SIG = {
    "tok_ptr": "*i64", "par_ptr": "*i32", "dep_ptr": "*i32", "val_ptr": "*i1", "idx_ptr": "*i32",
    "tok_out": "*i64", "par_out": "*i32", "dep_out": "*i32", "val_out": "*i1", "n": "i32",
    "BLOCK": "constexpr",
}
WALK_SIG = {
    "samples_ptr": "*i64", "cu_ptr": "*i32", "idx_ptr": "*i32", "tokens_ptr": "*i64",
    "parents_ptr": "*i32", "valid_ptr": "*i1", "acc_ptr": "*i64", "num_acc_ptr": "*i32",
    "out_tok_ptr": "*i64", "num_out_ptr": "*i32", "n": "i32", "max_depth": "i32",
    "pad_id": "i32", "stride_tok": "i32", "stride_par": "i32", "stride_val": "i32",
    "stride_acc": "i32", "stride_out": "i32", "BLOCK": "constexpr",
}


def compile_one(fn, sig, constexprs, **options):
    src = ASTSource(fn=triton.jit(fn), signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_info(compiled) -> dict:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True)
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill", res.stderr))
    return {"registers": regs, "spill_bytes": spills}


def main() -> int:
    bad = 0
    variants = []
    for has_root in (True, False):
        for block in (2, 64, 256, 1024):
            for pad_block in (0, 64):
                variants.append(("tree", _build_tree_kernel, TREE_SIG,
                                 {(12,): has_root, (13,): block, (14,): pad_block},
                                 {"num_warps": 1 if block < 256 else 4}))
    for dtype in ("*bf16", "*fp8e4nv", "*i64"):
        for bm, be in ((m, tile_width(m, 1 << 20)) for m in (2, 16, 64)):
            sig = dict(KV_SIG, kv_ptr=dtype)
            variants.append((f"kv{dtype}", _compact_kv_kernel, sig, {(13,): bm, (14,): be}, {}))
    for dtype in ("*bf16", "*fp8e4nv", "*i64"):
        for bm, be in ((m, tile_width(m, 1 << 20)) for m in (2, 16, 64)):
            sig = dict(PATH_SIG, kv_ptr=dtype)
            for has_pos in (True, False):
                variants.append((f"path{dtype}", _compact_path_kernel, sig,
                                 {(26,): True, (27,): True, (28,): has_pos, (29,): bm, (30,): be}, {}))
    for block in (16, 64, 1024):
        variants.append(("store", _store_by_state_kernel, STORE_SIG, {(10,): block}, {"num_warps": 1}))
    for dtype in ("*bf16", "*fp32"):
        for block, warps in ((4096, 4), (64, 1)):
            sig = {"x_ptr": dtype, "out_ptr": "*fp32", "row_stride": "i64", "vocab": "i32", "BLOCK": "constexpr"}
            variants.append((f"lse{dtype}", _logsumexp_kernel, sig, {(4,): block}, {"num_warps": warps}))
    for pdtype in ("*i32", "*i64"):
        for q in (2, 17, 65, 257, 513):
            block, rows, warps = tree_attn_bias_launch_config(q)
            sig = {"bias_ptr": "*fp32", "parents_ptr": pdtype, "idx_ptr": "*i32", "cu_ptr": "*i32",
                   "q": "i32", "parents_stride": "i32", "max_depth": "i32",
                   "ROWS": "constexpr", "BLOCK": "constexpr"}
            variants.append((f"bias{pdtype}", _tree_attn_bias_kernel, sig, {(7,): rows, (8,): block},
                             {"num_warps": warps}))
    for samples in ("*i64", "*i32"):
        for block in ((16, 64, 256, 1024) if samples == "*i64" else (1024,)):
            sig = dict(WALK_SIG, samples_ptr=samples)
            variants.append((f"walk{samples}", _walk_fused_kernel, sig, {(18,): block},
                             {"num_warps": 1 if block <= 128 else 4}))
    for pos, idx in (("*i64", "*i64"), ("*i64", "*i32"), ("*i32", "*i32")):
        sig = {"pos_ptr": pos, "rows_ptr": idx, "local_ptr": "*i32", "idx_ptr": idx,
               "depths_ptr": "*i32", "lin_ptr": pos, "n": "i32", "depths_stride0": "i32",
               "depths_stride1": "i32", "BLOCK": "constexpr"}
        variants.append((f"positions{pos}{idx}", _rewrite_positions_kernel, sig,
                         {(9,): REWRITE_POSITIONS_BLOCK}, {"num_warps": 4}))
    for name, fn, sig, consts, opts in variants:
        info = ptxas_info(compile_one(fn, sig, consts, **opts))
        info.update(kernel=name, constexprs={str(k[0]): v for k, v in consts.items()}, **opts)
        print(json.dumps(info))
        bad += info["spill_bytes"] > 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
