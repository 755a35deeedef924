"""vLLM's batch defaults for the OpenAI server on an H200-class GPU, with DDTree.

vLLM's own ``EngineArgs.create_engine_config`` resolves max_num_seqs and
max_num_batched_tokens here (``get_batch_defaults`` for usage context
OPENAI_API_SERVER: 1024 and 8192 on a GPU of 70 GiB or more), with only the device
queries it makes answered as an H200 would; then the patch
``engine_ddtree-batch-defaults`` hands them to
``vllm_ddtree.config.resolve_ddtree_batch_defaults`` and vLLM's ``VllmConfig``
reserves the DFlash drafter's slots (``_set_max_num_scheduled_tokens``). Without the
patch the README's configuration stops there with "max_num_scheduled_tokens is set to
-6144".

Needs the patched vLLM (``./apply.sh``).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")
import vllm.engine.arg_utils as arg_utils  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402
from vllm.usage.usage_lib import UsageContext  # noqa: E402
from vllm.utils.mem_constants import GiB_bytes  # noqa: E402

from bench.tiny_models import tiny_qwen3_config  # noqa: E402
from vllm_ddtree.config import DDTreeConfigError  # noqa: E402
from vllm_ddtree.reach_ins import PIN_0_26, installed_pin  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# The README's configuration: budget 64, at most 512 verified tokens a step.
README_SPEC = {"method": "ddtree", "num_speculative_tokens": 64, "ddtree_tokens_per_step": 512}
# The drafter's query slots per request in the target's batch: ddtree_max_depth 15
# (block size 16) - 1 on 0.26.0; 0.33.0 drafts in a separate query pass and reserves
# none, so vLLM's server defaults schedule as they are.
ON_0_26 = installed_pin() == PIN_0_26
DRAFTER_SLOTS = 14 if ON_0_26 else 0
only_0_26 = pytest.mark.skipif(not ON_0_26, reason="vLLM 0.26.0's drafter-slot accounting "
                               "(0.33.0 reserves no drafter slots)")
H200_MEMORY = 141 * GiB_bytes


def _write_model(path: Path, **fields) -> str:
    path.mkdir()
    config = tiny_qwen3_config(vocab_size=1024, hidden_size=64, intermediate_size=128,
                               head_dim=16, max_position_embeddings=32768,
                               torch_dtype="bfloat16")
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def write_models(root: Path) -> dict[str, str]:
    """A tiny Qwen3 target and DFlash drafter under ``root`` (configs only)."""
    return {
        "target": _write_model(root / "target", architectures=["Qwen3ForCausalLM"]),
        "drafter": _write_model(
            root / "drafter", architectures=["DFlashDraftModel"], num_hidden_layers=1,
            block_size=16, dflash_config={"mask_token_id": 0, "target_layer_ids": [1, 2]}),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_models(tmp_path_factory.mktemp("models"))


class H200Platform(CpuPlatform):
    """vLLM's CPU platform answering the device queries as one H200 does: 141 GiB,
    named "NVIDIA H200", not a CPU (vLLM's large-GPU batch defaults come from these
    three, ``EngineArgs.get_batch_defaults``), and keeping vLLM's asynchronous
    scheduling as the CUDA platform does (the CPU platform turns it off)."""

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return H200_MEMORY

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "NVIDIA H200"

    def is_cpu(self) -> bool:
        return False

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        async_scheduling = vllm_config.scheduler_config.async_scheduling
        super().check_and_update_config(vllm_config)
        vllm_config.scheduler_config.async_scheduling = async_scheduling


@pytest.fixture
def h200(monkeypatch):
    """vLLM's engine arguments and VllmConfig on an H200 (Triton has a driver there)."""
    return patch_h200(monkeypatch)


def patch_h200(monkeypatch: pytest.MonkeyPatch) -> H200Platform:
    """What :func:`h200` does, with ``monkeypatch`` (a process of its own, e.g.
    ``bench/scheduler_host.py``, passes a ``pytest.MonkeyPatch()`` it never undoes)."""
    import vllm.config.vllm as vllm_config_module
    import vllm.platforms

    platform = H200Platform()
    # vllm.platforms resolves it lazily; arg_utils bound it at import.
    monkeypatch.setattr(vllm.platforms, "current_platform", platform, raising=False)
    monkeypatch.setattr(arg_utils, "current_platform", platform)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    return platform


@pytest.fixture
def ddtree_log():
    """Records of vllm_ddtree.config's logger (a child of vLLM's, which does not
    propagate to pytest's root handler)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    log = logging.getLogger("vllm.ddtree")
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield records
    log.removeHandler(handler)
    log.setLevel(old_level)


def _server_config(models, spec=None, **engine_args):
    """What `vllm serve <target> --speculative-config <spec> ...` resolves to."""
    speculative = dict(README_SPEC if spec is None else spec, model=models["drafter"])
    args = AsyncEngineArgs(model=models["target"], skip_tokenizer_init=True,
                           speculative_config=speculative, **engine_args)
    return args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def test_vllm_picks_its_h200_server_defaults(h200):
    """The mocked device is one vLLM's own rule gives its large-GPU server defaults."""
    batched, seqs = AsyncEngineArgs.get_batch_defaults(world_size=1)
    assert batched[UsageContext.OPENAI_API_SERVER] == 8192
    assert seqs[UsageContext.OPENAI_API_SERVER] == 1024


def test_the_readme_configuration_starts_with_vllms_server_defaults(models, h200, ddtree_log):
    cfg = _server_config(models)
    scheduler = cfg.scheduler_config
    assert cfg.speculative_config.method == "ddtree"
    assert cfg.speculative_config.ddtree_max_depth == 15
    # vLLM's concurrency and tokens per step stand; the drafter's slots come on top.
    assert scheduler.max_num_seqs == 1024
    assert scheduler.max_num_scheduled_tokens == 8192
    assert scheduler.max_num_batched_tokens == 8192 + DRAFTER_SLOTS * 1024
    if not ON_0_26:  # vLLM's defaults as they are, and nothing to say about them
        assert not [r for r in ddtree_log if "->" in r.getMessage()]
        return
    # The DFlash drafter's query of a full batch fits its input buffer
    # (max_num_batched_tokens): 1024 requests x (1 + depth) tokens.
    assert 1024 * (1 + 15) <= scheduler.max_num_batched_tokens
    lines = [m for m in (r.getMessage() for r in ddtree_log)
             if "max_num_batched_tokens 8192 -> 22528" in m]
    assert len(lines) == 1, [r.getMessage() for r in ddtree_log]
    assert "14 x 1024 = 14336" in lines[0] and "keeps 8192 tokens a step" in lines[0]
    assert not [r for r in ddtree_log if "max_num_seqs 1024 ->" in r.getMessage()]


def _deploy_argv(models):
    """`vllm serve` arguments that deploy/entrypoint.sh builds from the Kubernetes
    base's ddtree.env, with the model paths pointed at the test's models."""
    from bench.serve_e2e import read_env_file

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DDTREE_", "MODEL", "MAX_", "GPU_", "TENSOR_", "EXTRA_"))}
    env.update(read_env_file(str(ROOT / "deploy/k8s/base/ddtree.env")))
    env.update(MODEL=models["target"], DDTREE_DRAFTER=models["drafter"], DRY_RUN="1")
    out = subprocess.run(["bash", str(ROOT / "deploy/entrypoint.sh")], env=env, text=True,
                         capture_output=True, timeout=60, check=True).stdout
    argv = shlex.split(out)
    assert argv[:3] == ["vllm", "serve", models["target"]], argv
    return argv[3:]


def test_the_image_and_kubernetes_base_start_with_vllms_server_defaults(
        models, h200, ddtree_log):
    try:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    except ImportError:  # 0.33.0 moved it
        from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = _deploy_argv(models)
    assert not any(a.startswith(("--max-num-seqs", "--max-num-batched-tokens")) for a in argv)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    args.model = models["target"]
    engine_args = AsyncEngineArgs.from_cli_args(args)
    engine_args.skip_tokenizer_init = True
    cfg = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    assert cfg.speculative_config.num_speculative_tokens == 64
    assert cfg.speculative_config.ddtree_tokens_per_step == 128
    assert cfg.model_config.max_model_len == 8192
    assert cfg.scheduler_config.max_num_seqs == 1024
    assert cfg.scheduler_config.max_num_scheduled_tokens == 8192
    assert cfg.scheduler_config.max_num_batched_tokens == 8192 + DRAFTER_SLOTS * 1024


@only_0_26
@pytest.mark.parametrize("usage", [UsageContext.LLM_CLASS, UsageContext.OPENAI_API_SERVER])
def test_the_raise_stops_where_vllm_caps_its_own_default(models, h200, ddtree_log, usage):
    """One request of at most 2048 tokens: vLLM caps its default at
    max_num_seqs x max_model_len = 2048, and so does DDTree's raise. (Raised to 2062,
    vLLM's warm-up ran one request of 2062 tokens past its 128-block table: an illegal
    memory access at start-up on the GPU.)"""
    speculative = dict(README_SPEC, model=models["drafter"])
    args = AsyncEngineArgs(model=models["target"], skip_tokenizer_init=True,
                           speculative_config=speculative, max_num_seqs=1,
                           max_model_len=2048)
    scheduler = args.create_engine_config(usage_context=usage).scheduler_config
    assert scheduler.max_num_seqs == 1
    assert scheduler.max_num_batched_tokens == 2048
    assert scheduler.max_num_scheduled_tokens == 2048 - DRAFTER_SLOTS
    assert not [r for r in ddtree_log if "->" in r.getMessage()]


@only_0_26
@pytest.mark.parametrize("max_num_seqs", [1, 2, 4, 16, 64])
@pytest.mark.parametrize("max_model_len", [256, 1024, 2048, 4096])
def test_no_warm_up_request_outgrows_max_model_len(models, h200, max_num_seqs, max_model_len):
    """vLLM's warm-up spreads max_num_batched_tokens over max_num_seqs requests
    (``_dummy_run``): none may be longer than max_model_len, and the scheduler keeps
    at least one token a step, for the engines the benchmark and the LLM class make."""
    speculative = dict(README_SPEC, model=models["drafter"])
    args = AsyncEngineArgs(model=models["target"], skip_tokenizer_init=True,
                           speculative_config=speculative, max_num_seqs=max_num_seqs,
                           max_model_len=max_model_len)
    scheduler = args.create_engine_config(usage_context=UsageContext.LLM_CLASS).scheduler_config
    assert scheduler.max_num_seqs == max_num_seqs
    tokens = scheduler.max_num_batched_tokens
    # _dummy_run's split: tokens // n each, the remainder on the last request.
    longest = tokens // max_num_seqs + tokens % max_num_seqs
    assert longest <= max_model_len
    assert scheduler.max_num_scheduled_tokens >= 1


@only_0_26
def test_a_capped_raise_logs_the_tokens_the_scheduler_keeps(models, h200, ddtree_log):
    """Two requests of at most 4100 tokens: vLLM's 8192 grows to the cap 2 x 4100 =
    8200, not to 8192 + 2 x 14, and the log line says the scheduler keeps 8200 - 28."""
    scheduler = _server_config(models, max_num_seqs=2, max_model_len=4100).scheduler_config
    assert scheduler.max_num_batched_tokens == 8200
    assert scheduler.max_num_scheduled_tokens == 8200 - DRAFTER_SLOTS * 2
    lines = [r.getMessage() for r in ddtree_log if "->" in r.getMessage()]
    assert len(lines) == 1 and "max_num_batched_tokens 8192 -> 8200" in lines[0], lines
    assert "keeps 8172 tokens a step" in lines[0]


def test_an_explicit_max_num_seqs_keeps_vllms_tokens_per_step(models, h200, ddtree_log):
    cfg = _server_config(models, max_num_seqs=64)
    assert cfg.scheduler_config.max_num_seqs == 64
    assert cfg.scheduler_config.max_num_scheduled_tokens == 8192
    assert cfg.scheduler_config.max_num_batched_tokens == 8192 + DRAFTER_SLOTS * 64


@only_0_26
def test_an_explicit_max_num_batched_tokens_lowers_the_default_max_num_seqs(
        models, h200, ddtree_log):
    cfg = _server_config(models, max_num_batched_tokens=8192)
    # The drafter's slots take at most half of the user's 8192: 4096 // 14 = 292.
    assert cfg.scheduler_config.max_num_batched_tokens == 8192
    assert cfg.scheduler_config.max_num_seqs == 292
    assert cfg.scheduler_config.max_num_scheduled_tokens == 8192 - DRAFTER_SLOTS * 292
    lines = [r.getMessage() for r in ddtree_log if "max_num_seqs 1024 -> 292" in r.getMessage()]
    assert len(lines) == 1 and "max_num_batched_tokens=8192 was given" in lines[0]


def test_a_large_explicit_max_num_batched_tokens_keeps_vllms_max_num_seqs(
        models, h200, ddtree_log):
    cfg = _server_config(models, max_num_batched_tokens=32768)
    assert cfg.scheduler_config.max_num_seqs == 1024
    assert cfg.scheduler_config.max_num_batched_tokens == 32768
    assert cfg.scheduler_config.max_num_scheduled_tokens == 32768 - DRAFTER_SLOTS * 1024
    assert not [r for r in ddtree_log if "->" in r.getMessage()]


@only_0_26
def test_explicit_settings_that_leave_nothing_to_schedule_are_refused_naming_both(
        models, h200):
    with pytest.raises(DDTreeConfigError) as err:
        _server_config(models, max_num_batched_tokens=8192, max_num_seqs=1024)
    message = str(err.value)
    assert "max_num_batched_tokens=8192 with max_num_seqs=1024 leaves -6144 tokens" in message
    assert "max_num_batched_tokens to at least 22528" in message
    assert "max_num_seqs to at most 292" in message
    # Each way out it names starts.
    assert _server_config(models, max_num_batched_tokens=22528, max_num_seqs=1024) \
        .scheduler_config.max_num_scheduled_tokens == 8192
    assert _server_config(models, max_num_batched_tokens=8192, max_num_seqs=292) \
        .scheduler_config.max_num_seqs == 292


def test_an_explicit_max_num_scheduled_tokens_is_kept(models, h200, ddtree_log):
    """The user's tokens a step, with the drafter's slots on top."""
    cfg = _server_config(models, max_num_scheduled_tokens=4096)
    assert cfg.scheduler_config.max_num_scheduled_tokens == 4096
    assert cfg.scheduler_config.max_num_seqs == 1024
    # On 0.33.0 vLLM's own max_num_batched_tokens (8192) stands.
    assert cfg.scheduler_config.max_num_batched_tokens == (
        4096 + DRAFTER_SLOTS * 1024 if ON_0_26 else 8192)


@only_0_26
def test_other_speculative_methods_keep_vllms_own_resolution(models, h200, ddtree_log):
    """The hook is DDTree's only: vLLM's DFlash chain with the same drafter still
    meets vLLM's own accounting (and its error) at these defaults."""
    with pytest.raises(Exception, match="max_num_scheduled_tokens is set to -6144"):
        _server_config(models, {"method": "dflash", "num_speculative_tokens": 15})
    assert not ddtree_log
