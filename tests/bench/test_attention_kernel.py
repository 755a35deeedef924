"""bench/attention_kernel.py: the kernel benchmark's inputs and its correctness check.

The timing needs a GPU (its results go under bench/results/); here the script runs in
Triton's interpreter at a small shape, where it checks the installed, patched kernel
with and without the tree-bias argument against a dense reference, and the reference
itself is shown to notice a wrong KV placement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# bench.attention_kernel is imported in the tests, not here: collecting this module must
# not import Triton before tests/unit/conftest.py has chosen its interpreter.

SMALL = dict(q_heads=4, kv_heads=2, head_size=32, block_size=16, tree_nodes=9,
             dtype=torch.float32, device="cpu", seed=3, seq_len_range=(5, 60))


def test_interleaved_placement_gives_every_other_block():
    from bench import attention_kernel as ak

    b = ak.build_inputs(3, placement="interleaved", **SMALL)
    used = b["block_table"][b["block_table"] >= 0]
    rows = [b["block_table"][s, : (int(n) + 15) // 16].tolist() for s, n in enumerate(b["seqused_k"])]
    flat = [x for r in rows for x in r]
    assert flat == list(range(0, 2 * len(flat), 2)) and len(set(flat)) == len(flat)
    assert b["k"].shape[0] >= max(flat) + 1 and used.numel() > 0
    c = ak.build_inputs(3, placement="contiguous", **SMALL)
    rows_c = [c["block_table"][s, : (int(n) + 15) // 16].tolist() for s, n in enumerate(c["seqused_k"])]
    assert [x for r in rows_c for x in r] == list(range(len(flat)))
    # K and V are views into one tensor, as vLLM's Triton backend splits its cache.
    assert b["k"].data_ptr() + 32 * b["k"].element_size() == b["v"].data_ptr()
    assert b["q"].shape == (3, 4, 32) and b["bias"].shape == (3, 9, 9)
    assert not b["bias"].any()  # zero rows: no tree


def test_the_reference_notices_a_wrong_kv_placement():
    from bench import attention_kernel as ak

    b = ak.build_inputs(2, placement="contiguous", **SMALL)
    ref = ak.reference_decode(b)
    wrong = dict(b, block_table=b["block_table"].flip(0))
    assert (ak.reference_decode(wrong) - ref).abs().max() > 0.1


def _interpreted(tmp_path, *args: str) -> dict:
    """bench/attention_kernel.py --device cpu in Triton's interpreter; its record."""
    pytest.importorskip("vllm")
    pytest.importorskip("triton")
    out = tmp_path / "attention-kernel.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "attention_kernel.py"), "--device", "cpu",
         *args, "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_both_variants_match_the_dense_reference_in_the_interpreter(tmp_path):
    record = _interpreted(tmp_path, "--batch-sizes", "1", "3")
    cells = record["cells"]
    assert {(c["batch"], c["placement"]) for c in cells} == {
        (1, "contiguous"), (1, "interleaved"), (3, "contiguous"), (3, "interleaved")}
    for c in cells:
        assert set(c["max_abs_err"]) == {"no-bias", "bias"}
        assert max(c["max_abs_err"].values()) < 1e-4, c


def test_both_grids_match_the_dense_reference_in_the_interpreter(tmp_path):
    """--compare split: the kernel without the bias on vLLM's 2D grid and on its 3D
    split-softmax grid, each against the dense reference."""
    record = _interpreted(tmp_path, "--compare", "split", "--batch-sizes", "2",
                          "--placements", "interleaved")
    assert record["compare"] == "split"
    (cell,) = record["cells"]
    assert set(cell["max_abs_err"]) == {"2d", "3d"}
    assert max(cell["max_abs_err"].values()) < 1e-4, cell


def test_the_split_comparison_runs_each_grid():
    from bench import attention_kernel as ak

    assert ak.variants("split", 64, 40) == {"2d": (False, 0), "3d": (False, 64)}
    assert ak.variants("bias", 64, 40) == {"no-bias": (False, 40), "bias": (True, 40)}
