"""GPU wrapper of bench/serve_e2e.py: the whole end-to-end server check, when a GPU
and the SmolLM2 target are present (SERVE_E2E_TARGET=<HF folder of
SmolLM2-135M-Instruct>); skipped everywhere else."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = os.environ.get("SERVE_E2E_TARGET", "")


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not _cuda(), reason="needs an NVIDIA GPU")
@pytest.mark.skipif(not os.path.isdir(TARGET), reason="set SERVE_E2E_TARGET to the SmolLM2 HF folder")
def test_serve_e2e_on_gpu(tmp_path):
    out = tmp_path / "serve-e2e.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "serve_e2e.py"), "--target", TARGET,
         "--drafter", os.path.join(REPO, "bench", "fixture", "smollm2-dflash"),
         "--out", str(out), "--log-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=560,
    )
    result = json.loads(out.read_text())
    assert proc.returncode == 0, (result.get("failures"), proc.stdout[-4000:])
