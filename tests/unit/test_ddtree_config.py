"""speculative_config={"method": "ddtree", ...} through vLLM's own config classes.

Needs the patched vLLM (``./apply.sh``): the method is added by the patch
``spec-decode_ddtree-config.patch`` and validated by ``vllm_ddtree.config``.
"""

import json
import types

import pytest
import torch

pytest.importorskip("vllm")
from vllm.config import (  # noqa: E402
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)

from bench.tiny_models import TINY_DRAFTERS, tiny_qwen3_config  # noqa: E402
from vllm_ddtree.config import (  # noqa: E402
    MAX_TREE_BUDGET,
    DDTreeConfigError,
    validate_ddtree_vllm_config,
)
from vllm_ddtree.reach_ins import PIN_0_26, installed_pin  # noqa: E402

VOCAB = 1024
PIN = installed_pin()


def drafter_slots(depth: int) -> int:
    """Slots the drafter's query takes in the target's batch per request: 0.26.0
    reserves the query's depth - 1 mask positions beyond the budget (patch
    spec-decode_ddtree-config); 0.33.0 drafts DFlash (and so DDTree) in a separate
    query pass and reserves none."""
    return depth - 1 if PIN == PIN_0_26 else 0


def _write_config(path, **fields):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(fields))
    return str(path)


def _qwen3_fields(**extra):
    # The shared tiny Qwen3 (bench/tiny_models.py), smaller still: only configs are built.
    fields = tiny_qwen3_config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                               head_dim=16, max_position_embeddings=2048,
                               torch_dtype="bfloat16")
    fields.update(extra)
    return fields


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = _write_config(
        root / "target", architectures=["Qwen3ForCausalLM"], **_qwen3_fields()
    )
    drafter = _write_config(
        root / "dflash",
        architectures=["DFlashDraftModel"],
        block_size=16,
        dflash_config=dict(mask_token_id=0, target_layer_ids=[1, 2]),
        **_qwen3_fields(num_hidden_layers=1),
    )
    not_dflash = _write_config(
        root / "plain", architectures=["Qwen3ForCausalLM"], **_qwen3_fields()
    )
    no_block = _write_config(
        root / "dflash-noblock",
        architectures=["DFlashDraftModel"],
        dflash_config=dict(mask_token_id=0, target_layer_ids=[1, 2]),
        **_qwen3_fields(num_hidden_layers=1),
    )
    # A tiny random DFlash2 drafter (vLLM 0.33.0's DFlash2Qwen3ForCausalLM): block 8,
    # grouped convolutions and a candidate selector of top 8.
    dflash2 = _write_config(root / "dflash2", **TINY_DRAFTERS["dflash2"],
                            **_qwen3_fields(num_hidden_layers=1))
    beam = _write_config(
        root / "dflash2-beam",
        architectures=["DFlash2BeamDraftModel"],
        block_size=8,
        dflash_config=dict(mask_token_id=0, target_layer_ids=[1, 2], conv_kernel_size=3,
                           conv_group_size=16, selector_rank=8, selector_top_k=8),
        **_qwen3_fields(num_hidden_layers=1),
    )
    return dict(target=target, drafter=drafter, not_dflash=not_dflash, no_block=no_block,
                dflash2=dflash2, dflash2_beam=beam)


@pytest.fixture(scope="module")
def target_config(model_dirs):
    return ModelConfig(model=model_dirs["target"], skip_tokenizer_init=True)


def _spec(target_config, model, **options):
    return SpeculativeConfig(
        method="ddtree",
        model=model,
        target_model_config=target_config,
        target_parallel_config=ParallelConfig(),
        **options,
    )


def test_valid_config_resolves_defaults(model_dirs, target_config):
    spec = _spec(target_config, model_dirs["drafter"], num_speculative_tokens=32)
    assert spec.method == "ddtree"
    assert spec.use_ddtree() and spec.use_dflash() and spec.use_eagle()
    assert spec.ddtree_max_depth == 15  # block_size 16 - 1
    assert spec.ddtree_top_k == 32  # min(budget, vocab)
    assert spec.parallel_drafting
    # The drafter is loaded as a DFlash drafter.
    assert spec.draft_model_config.hf_config.architectures == ["DFlashDraftModel"]
    # The drafter adds its block (on 0.26.0), not the tree budget, to the batch.
    assert spec.max_num_new_slots_for_drafting == drafter_slots(15)


def test_explicit_depth_and_top_k(model_dirs, target_config):
    spec = _spec(
        target_config,
        model_dirs["drafter"],
        num_speculative_tokens=64,
        ddtree_max_depth=6,
        ddtree_top_k=4,
    )
    assert (spec.ddtree_max_depth, spec.ddtree_top_k) == (6, 4)
    assert spec.max_num_new_slots_for_drafting == drafter_slots(6)


ON_0_33 = pytest.mark.skipif(
    PIN == PIN_0_26, reason="vLLM 0.26.0 has no DFlash2 drafters (DFlash2DraftModel came "
    "with the 0.33.0 pin)")


@ON_0_33
def test_a_dflash2_drafter_takes_its_block_for_the_depth(model_dirs, target_config):
    spec = _spec(target_config, model_dirs["dflash2"], num_speculative_tokens=32)
    assert spec.use_ddtree() and spec.use_dflash()
    assert spec.draft_model_config.hf_config.architectures == ["DFlash2DraftModel"]
    assert spec.ddtree_max_depth == 7  # block_size 8 - 1
    assert spec.ddtree_top_k == 32  # the trees take full per-position logits
    assert spec.max_num_new_slots_for_drafting == drafter_slots(7)


@ON_0_33
def test_a_dflash2_drafter_bounds_the_depth_by_its_block(model_dirs, target_config):
    spec = _spec(target_config, model_dirs["dflash2"], num_speculative_tokens=16,
                 ddtree_max_depth=4)
    assert spec.ddtree_max_depth == 4
    with pytest.raises(ValueError, match="ddtree_max_depth=8 is out of range"):
        _spec(target_config, model_dirs["dflash2"], num_speculative_tokens=16,
              ddtree_max_depth=8)


@pytest.mark.skipif(PIN == PIN_0_26, reason="adaptive verification came with vLLM 0.33.0")
def test_adaptive_verification_is_refused_naming_the_setting(model_dirs, target_config):
    # vLLM's own per-request draft trimming (dspark); DDTree sizes its trees itself.
    with pytest.raises(ValueError, match="enable_adaptive_verification=True is not supported"):
        _spec(target_config, model_dirs["drafter"], num_speculative_tokens=8,
              enable_adaptive_verification=True)


@ON_0_33
def test_a_dflash2_engine_config_passes_ddtree_checks(model_dirs, target_config, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    spec = _spec(target_config, model_dirs["dflash2"], num_speculative_tokens=32)
    validate_ddtree_vllm_config(_engine_config(target_config, spec))


@pytest.mark.skipif(PIN != PIN_0_26, reason="the refusal on a pin without DFlash2 "
                    "drafters; 0.33.0 serves them")
def test_a_dflash2_drafter_is_refused_at_start_up_on_0_26(model_dirs, target_config):
    # vLLM 0.26.0 refuses the architecture itself while building the drafter's
    # ModelConfig, before DDTree's hook (whose own message names the 0.33.0 pin).
    with pytest.raises(ValueError, match=r"\['DFlash2DraftModel'\] are not supported"):
        _spec(target_config, model_dirs["dflash2"], num_speculative_tokens=32)


@ON_0_33
def test_other_candidate_head_drafters_are_refused(model_dirs, target_config):
    with pytest.raises(ValueError, match="DFlash2BeamDraftModel drafter; DDTree drives"):
        _spec(target_config, model_dirs["dflash2_beam"], num_speculative_tokens=32)


def test_ddtrees_own_dflash2_refusal_names_the_pins(monkeypatch):
    """Where the drafter's config gets through (a DFlash2 config on a pin without
    DFlash2 drafters), DDTree's check names the pins that serve them."""
    from vllm_ddtree import config as ddtree_config
    from vllm_ddtree import reach_ins

    hf = types.SimpleNamespace(architectures=["DFlash2DraftModel"])
    monkeypatch.setattr(reach_ins, "installed_pin", lambda: PIN_0_26)
    with pytest.raises(DDTreeConfigError, match=r"serves on vLLM 0.33.0 only; the "
                       r"installed vLLM is 0.26.0 \(set it up with DDTREE_VLLM=0.33.0"):
        ddtree_config._check_drafter_kind(hf, "d2")
    monkeypatch.setattr(reach_ins, "installed_pin", lambda: "0.33.0")
    ddtree_config._check_drafter_kind(hf, "d2")
    ddtree_config._check_drafter_kind(types.SimpleNamespace(architectures=["DFlashDraftModel"]),
                                      "d1")


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_speculative_tokens=MAX_TREE_BUDGET + 1), "tree budget"),
        (dict(num_speculative_tokens=8, ddtree_max_depth=16), "ddtree_max_depth"),
        (dict(num_speculative_tokens=8, ddtree_max_depth=0), "ddtree_max_depth"),
        (dict(num_speculative_tokens=8, ddtree_top_k=9), "ddtree_top_k"),
        (dict(num_speculative_tokens=8, ddtree_top_k=0), "ddtree_top_k"),
        (
            dict(num_speculative_tokens=8, rejection_sample_method="synthetic"),
            "rejection_sample_method",
        ),
    ],
)
def test_bad_options_name_the_setting(model_dirs, target_config, options, message):
    with pytest.raises(ValueError, match=message):
        _spec(target_config, model_dirs["drafter"], **options)


def test_non_positive_budget_is_refused(model_dirs, target_config):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _spec(target_config, model_dirs["drafter"], num_speculative_tokens=0)


def test_drafter_must_be_dflash(model_dirs, target_config):
    # pydantic wraps DDTreeConfigError (a ValueError) in its ValidationError.
    with pytest.raises(ValueError, match="must be a DFlash drafter"):
        _spec(target_config, model_dirs["not_dflash"], num_speculative_tokens=8)


def test_drafter_without_block_size_needs_depth(model_dirs, target_config):
    with pytest.raises(ValueError, match="no block_size"):
        _spec(target_config, model_dirs["no_block"], num_speculative_tokens=8)
    spec = _spec(
        target_config,
        model_dirs["no_block"],
        num_speculative_tokens=8,
        ddtree_max_depth=7,
    )
    assert spec.ddtree_max_depth == 7


def test_drafter_is_required(target_config):
    with pytest.raises(ValueError):
        SpeculativeConfig(
            method="ddtree",
            num_speculative_tokens=8,
            target_model_config=target_config,
            target_parallel_config=ParallelConfig(),
        )


def test_ddtree_defaults_to_full_cuda_graphs_on_triton(model_dirs, target_config, monkeypatch):
    """Steps that prefill a joining request replay one whole-forward graph (their
    piecewise replay cost 7.6 ms of host launches against 2.1 ms:
    bench/results/2026-11-30-steady-varied-lengths-full-graphs/)."""
    from vllm.config.compilation import CUDAGraphMode

    from vllm_ddtree.config import TREE_ATTENTION_ENV, ddtree_cudagraph_mode

    monkeypatch.delenv(TREE_ATTENTION_ENV, raising=False)
    spec = _spec(target_config, model_dirs["drafter"], num_speculative_tokens=64,
                 ddtree_tokens_per_step=512)
    level_default = CUDAGraphMode.FULL_AND_PIECEWISE  # vLLM's O2 and O3
    cfg = _graph_config(target_config, spec)
    assert cfg.compilation_config.cudagraph_mode is None  # not set by the user
    assert ddtree_cudagraph_mode(cfg, level_default) == CUDAGraphMode.FULL
    # vLLM's level defaults, applied right after the hook, fill only what is unset.
    VllmConfig._set_config_default(cfg, cfg.compilation_config, "cudagraph_mode", level_default)
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.FULL

    # Kept: the user's mode, levels without FULL graphs, eager engines, other methods,
    # and trees on FlashAttention.
    user = _graph_config(target_config, spec, cudagraph_mode="PIECEWISE")
    assert ddtree_cudagraph_mode(user, level_default) is None
    assert user.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    for level in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        low = _graph_config(target_config, spec)
        assert ddtree_cudagraph_mode(low, level) is None
        assert low.compilation_config.cudagraph_mode is None
    eager = _graph_config(target_config, spec)
    eager.model_config = types.SimpleNamespace(enforce_eager=True)
    assert ddtree_cudagraph_mode(eager, level_default) is None
    chain = _graph_config(target_config, types.SimpleNamespace(method="dflash"))
    assert ddtree_cudagraph_mode(chain, level_default) is None
    monkeypatch.setenv(TREE_ATTENTION_ENV, "flash")
    flash = _graph_config(target_config, spec)
    assert ddtree_cudagraph_mode(flash, level_default) is None
    assert flash.compilation_config.cudagraph_mode is None


def test_the_graph_mode_default_runs_before_vllm_applies_its_level_defaults():
    """The mode hook must come before VllmConfig._apply_optimization_level_defaults,
    which sets FULL_AND_PIECEWISE wherever the mode is still unset."""
    import inspect

    source = inspect.getsource(VllmConfig.__post_init__)
    hook = source.find("ddtree_cudagraph_mode(")
    assert hook != -1, "the series is not applied to this vLLM"
    assert hook < source.find("self._apply_optimization_level_defaults(default_config)")


# --- engine-level checks (VllmConfig) ---------------------------------------------
# VllmConfig itself cannot be built without a GPU platform; these checks run on
# vLLM's real sub-configs with VllmConfig's own feature probe bound to them.


def _engine_config(target_config, spec, **overrides):
    parallel = overrides.pop("parallel_config", ParallelConfig())
    scheduler = overrides.pop(
        "scheduler_config",
        SchedulerConfig(
            max_model_len=target_config.max_model_len,
            is_encoder_decoder=False,
            max_num_batched_tokens=8192,
        ),
    )
    cfg = types.SimpleNamespace(
        model_config=target_config,
        speculative_config=spec,
        parallel_config=parallel,
        scheduler_config=scheduler,
        compilation_config=CompilationConfig(),
        cache_config=CacheConfig(),
        attention_config=overrides.pop("attention_config", AttentionConfig()),
        ec_transfer_config=None,
        **overrides,
    )
    cfg._get_v2_model_runner_unsupported_features = types.MethodType(
        VllmConfig._get_v2_model_runner_unsupported_features, cfg
    )
    return cfg


@pytest.fixture
def spec32(model_dirs, target_config):
    return _spec(target_config, model_dirs["drafter"], num_speculative_tokens=32)


def test_engine_checks_pass_for_a_dense_qwen3_target(
    target_config, spec32, monkeypatch
):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    validate_ddtree_vllm_config(_engine_config(target_config, spec32))


def test_tree_attention_backend_is_selected(target_config, spec32, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    cfg = _engine_config(target_config, spec32)
    validate_ddtree_vllm_config(cfg)
    assert cfg.attention_config.backend.name == "TRITON_ATTN"


def test_flash_tree_attention_is_opt_in(target_config, spec32, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setenv("VLLM_DDTREE_TREE_ATTENTION", "flash")
    cfg = _engine_config(target_config, spec32)
    validate_ddtree_vllm_config(cfg)
    assert cfg.attention_config.backend.name == "FLASH_ATTN"
    # A user's explicit FLASH_ATTN is accepted with the switch ...
    cfg = _engine_config(
        target_config, spec32, attention_config=AttentionConfig(backend="FLASH_ATTN")
    )
    validate_ddtree_vllm_config(cfg)
    # ... and TRITON_ATTN is then refused, naming the switch's backend.
    cfg = _engine_config(
        target_config, spec32, attention_config=AttentionConfig(backend="TRITON_ATTN")
    )
    with pytest.raises(DDTreeConfigError, match="FLASH_ATTN"):
        validate_ddtree_vllm_config(cfg)


def test_other_attention_backend_is_refused_naming_the_switch(target_config, spec32,
                                                              monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.delenv("VLLM_DDTREE_TREE_ATTENTION", raising=False)
    cfg = _engine_config(
        target_config, spec32, attention_config=AttentionConfig(backend="FLASH_ATTN")
    )
    with pytest.raises(DDTreeConfigError, match="FLASH_ATTN.*VLLM_DDTREE_TREE_ATTENTION=flash"):
        validate_ddtree_vllm_config(cfg)


def test_return_sampling_mask_is_refused_at_start_up(target_config, spec32, monkeypatch):
    """vLLM 0.33.0's ModelConfig.return_sampling_mask: the tree sampler returns no
    masks, so answers would silently lack them."""
    if "return_sampling_mask" not in type(target_config).__dataclass_fields__:
        pytest.skip(f"vLLM {PIN} has no ModelConfig.return_sampling_mask")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.delenv("VLLM_DDTREE_TREE_ATTENTION", raising=False)
    validate_ddtree_vllm_config(_engine_config(target_config, spec32))
    monkeypatch.setattr(target_config, "return_sampling_mask", True)
    with pytest.raises(DDTreeConfigError, match="return_sampling_mask=True.*no sampling masks"):
        validate_ddtree_vllm_config(_engine_config(target_config, spec32))


def test_bad_tree_attention_switch_is_refused(target_config, spec32, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setenv("VLLM_DDTREE_TREE_ATTENTION", "fa3")
    with pytest.raises(DDTreeConfigError, match="VLLM_DDTREE_TREE_ATTENTION='fa3'"):
        validate_ddtree_vllm_config(_engine_config(target_config, spec32))


def test_flash_tree_attention_refuses_an_fp8_kv_cache(target_config, spec32, monkeypatch):
    from vllm_ddtree.config import validate_flash_tree_attention

    cfg = types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(num_speculative_tokens=128),
        cache_config=types.SimpleNamespace(cache_dtype="auto"),
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1), model_config=None)
    with pytest.raises(DDTreeConfigError, match="at most 127 nodes"):
        validate_flash_tree_attention(cfg)
    cfg = types.SimpleNamespace(cache_config=types.SimpleNamespace(cache_dtype="fp8_e4m3"),
                          parallel_config=types.SimpleNamespace(decode_context_parallel_size=1),
                          model_config=None)
    with pytest.raises(DDTreeConfigError, match="unquantized KV cache"):
        validate_flash_tree_attention(cfg)
    cfg.cache_config.cache_dtype = "auto"
    cfg.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(DDTreeConfigError, match="decode context parallelism"):
        validate_flash_tree_attention(cfg)
    cfg.parallel_config.decode_context_parallel_size = 1
    cfg.model_config = types.SimpleNamespace(hf_text_config=types.SimpleNamespace(
        sliding_window=4096, use_sliding_window=True))
    with pytest.raises(DDTreeConfigError, match="sliding_window=4096"):
        validate_flash_tree_attention(cfg)
    # Qwen3 configs name a window they do not use.
    cfg.model_config.hf_text_config.use_sliding_window = False
    validate_flash_tree_attention(cfg)
    # FlashAttention has no float32 kernels (the exactness checks run float32).
    cfg.model_config.dtype = torch.float32
    with pytest.raises(DDTreeConfigError, match="float16 or bfloat16 model.*dtype=float32"):
        validate_flash_tree_attention(cfg)
    cfg.model_config.dtype = torch.bfloat16
    validate_flash_tree_attention(cfg)


def test_v1_runner_is_refused(target_config, spec32, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(DDTreeConfigError, match="V2 model runner"):
        validate_ddtree_vllm_config(_engine_config(target_config, spec32))


def test_jit_monitor_error_mode_is_refused_at_start_up(target_config, spec32, monkeypatch):
    # vLLM's DFlash input kernel compiles while serving
    # (bench/results/2026-11-30-steady-plain-chain-trees-both-orders/jit-during-serving-ddtree-b64-t512.json.gz): the
    # error mode would kill the engine at its first requests instead.
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    cfg = _engine_config(target_config, spec32,
                         observability_config=ObservabilityConfig(jit_monitor_mode="error"))
    with pytest.raises(DDTreeConfigError, match="jit-monitor-mode error.*warn"):
        validate_ddtree_vllm_config(cfg)
    cfg.observability_config = ObservabilityConfig(jit_monitor_mode="warn",
                                                   jit_monitor_verbose=True)
    validate_ddtree_vllm_config(cfg)


def test_pipeline_parallelism_is_refused(target_config, spec32, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    cfg = _engine_config(
        target_config, spec32, parallel_config=ParallelConfig(pipeline_parallel_size=2)
    )
    with pytest.raises(DDTreeConfigError, match="pipeline parallelism"):
        validate_ddtree_vllm_config(cfg)


@pytest.mark.skipif(PIN != PIN_0_26, reason="KV sharing fast prefill forces the V1 "
                    "runner on vLLM 0.26.0 only; 0.33.0's V2 runner supports it")
def test_features_that_force_the_v1_runner_are_refused(
    target_config, spec32, monkeypatch
):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    cfg = _engine_config(target_config, spec32)
    cfg.cache_config.kv_sharing_fast_prefill = True
    with pytest.raises(DDTreeConfigError, match="KV sharing fast prefill"):
        validate_ddtree_vllm_config(cfg)


def test_what_the_v2_runner_does_not_support_is_refused(target_config, spec32, monkeypatch):
    """On any pin: the features vLLM's own list says the V2 runner lacks are named."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    cfg = _engine_config(target_config, spec32)
    validate_ddtree_vllm_config(cfg)
    cfg._get_v2_model_runner_unsupported_features = lambda: ["feature A", "feature B"]
    with pytest.raises(DDTreeConfigError, match="does not support: feature A, feature B"):
        validate_ddtree_vllm_config(cfg)


def test_token_budget_must_hold_one_tree(target_config, model_dirs, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    spec = _spec(target_config, model_dirs["drafter"], num_speculative_tokens=256)
    scheduler = SchedulerConfig(
        max_model_len=target_config.max_model_len,
        is_encoder_decoder=False,
        max_num_batched_tokens=128,
        max_num_seqs=4,
    )
    with pytest.raises(DDTreeConfigError, match="max_num_batched_tokens"):
        validate_ddtree_vllm_config(
            _engine_config(target_config, spec, scheduler_config=scheduler)
        )


def test_target_without_aux_hidden_states_is_refused(
    tmp_path, spec32, monkeypatch
):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    # GPT-2 does not implement SupportsEagle3, so it cannot feed a DFlash drafter.
    gpt2 = _write_config(
        tmp_path / "gpt2",
        architectures=["GPT2LMHeadModel"],
        model_type="gpt2",
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=1024,
    )
    target = ModelConfig(model=gpt2, skip_tokenizer_init=True)
    with pytest.raises(DDTreeConfigError, match="auxiliary hidden states"):
        validate_ddtree_vllm_config(_engine_config(target, spec32))


# --- batch-aware budget ---------------------------------------------------------------


def test_tokens_per_step_fills_the_batch_size_schedule(model_dirs, target_config):
    spec = _spec(
        target_config, model_dirs["drafter"], num_speculative_tokens=64,
        ddtree_tokens_per_step=512,
    )
    assert spec.num_speculative_tokens_per_batch_size[0] == (1, 7, 64)
    assert spec.uses_dynamic_speculative_decoding()


def test_tokens_per_step_and_an_explicit_schedule_are_refused(model_dirs, target_config):
    with pytest.raises(ValueError, match="not both"):
        _spec(
            target_config, model_dirs["drafter"], num_speculative_tokens=32,
            ddtree_tokens_per_step=256,
            num_speculative_tokens_per_batch_size=[(1, 8, 32), (9, 64, 8)],
        )


def test_tokens_per_step_must_be_a_positive_integer(model_dirs, target_config):
    with pytest.raises(ValueError, match="ddtree_tokens_per_step"):
        _spec(target_config, model_dirs["drafter"], num_speculative_tokens=32,
              ddtree_tokens_per_step=1)


def test_auto_tokens_per_step_starts_with_a_provisional_schedule(model_dirs, target_config):
    """"auto": the full budget at every batch size until the engine core measures the
    target (vllm_ddtree.cost_model); a schedule from the start, so vLLM treats the
    budget as batch-dependent; with drafting off from N, that range stays."""
    spec = _spec(target_config, model_dirs["drafter"], num_speculative_tokens=64,
                 ddtree_tokens_per_step="auto")
    assert spec.ddtree_tokens_per_step == "auto"
    assert spec.num_speculative_tokens_per_batch_size == [(1, 1 << 20, 64)]
    assert spec.uses_dynamic_speculative_decoding()
    off = _spec(target_config, model_dirs["drafter"], num_speculative_tokens=64,
                ddtree_tokens_per_step="auto", ddtree_disable_by_batch_size=16)
    assert off.num_speculative_tokens_per_batch_size == [(1, 15, 64), (16, 1 << 20, 0)]


@pytest.mark.parametrize("value", ["fast", "automatic"])
def test_a_word_other_than_auto_is_refused(model_dirs, target_config, value):
    with pytest.raises(ValueError, match="ddtree_tokens_per_step"):
        _spec(target_config, model_dirs["drafter"], num_speculative_tokens=32,
              ddtree_tokens_per_step=value)


def test_auto_tokens_per_step_refuses_data_parallelism(model_dirs, target_config, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    spec = _spec(target_config, model_dirs["drafter"], num_speculative_tokens=32,
                 ddtree_tokens_per_step="auto")
    validate_ddtree_vllm_config(_engine_config(
        target_config, spec, scheduler_config=_scheduler(target_config, True)))
    with pytest.raises(DDTreeConfigError, match="auto.*data_parallel_size=2"):
        validate_ddtree_vllm_config(_engine_config(
            target_config, spec, scheduler_config=_scheduler(target_config, True),
            parallel_config=ParallelConfig(data_parallel_size=2)))


def test_disable_by_batch_size_ends_the_schedule_with_budget_zero(model_dirs, target_config):
    spec = _spec(target_config, model_dirs["drafter"], num_speculative_tokens=64,
                 ddtree_tokens_per_step=512, ddtree_disable_by_batch_size=16)
    assert spec.num_speculative_tokens_per_batch_size == [
        (1, 7, 64), (8, 15, 32), (16, 1 << 20, 0)]
    alone = _spec(target_config, model_dirs["drafter"], num_speculative_tokens=32,
                  ddtree_disable_by_batch_size=4)
    assert alone.num_speculative_tokens_per_batch_size == [(1, 3, 32), (4, 1 << 20, 0)]
    assert alone.uses_dynamic_speculative_decoding()


@pytest.mark.parametrize("options, message", [
    (dict(ddtree_disable_by_batch_size=1), "ddtree_disable_by_batch_size=1 is out of range"),
    (dict(ddtree_disable_by_batch_size=2.5), "ddtree_disable_by_batch_size"),
    (dict(ddtree_disable_by_batch_size=8,
          num_speculative_tokens_per_batch_size=[(1, 8, 32), (9, 64, 8)]), "not both"),
])
def test_bad_disable_by_batch_size_names_the_setting(model_dirs, target_config, options, message):
    with pytest.raises(ValueError, match=message):
        _spec(target_config, model_dirs["drafter"], num_speculative_tokens=32, **options)


def _scheduler(target_config, async_scheduling):
    return SchedulerConfig(
        max_model_len=target_config.max_model_len, is_encoder_decoder=False,
        max_num_batched_tokens=8192, async_scheduling=async_scheduling,
    )


@pytest.mark.parametrize("option", [dict(ddtree_tokens_per_step=256),
                                    dict(ddtree_disable_by_batch_size=8)])
def test_budget_schedule_needs_async_scheduling(model_dirs, target_config, monkeypatch, option):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    spec = _spec(target_config, model_dirs["drafter"], num_speculative_tokens=32, **option)
    with pytest.raises(DDTreeConfigError, match="asynchronous scheduling"):
        validate_ddtree_vllm_config(_engine_config(
            target_config, spec, scheduler_config=_scheduler(target_config, False)))
    validate_ddtree_vllm_config(_engine_config(
        target_config, spec, scheduler_config=_scheduler(target_config, True)))


def test_trees_outgrowing_cuda_graphs_are_warned_about(model_dirs, target_config, monkeypatch,
                                                        caplog):
    from vllm_ddtree.config import warn_if_trees_outgrow_cuda_graphs

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)

    def cfg(spec, max_num_seqs):
        return _engine_config(target_config, spec, scheduler_config=SchedulerConfig(
            max_model_len=target_config.max_model_len, is_encoder_decoder=False,
            max_num_batched_tokens=8192, max_num_seqs=max_num_seqs))

    spec = _spec(target_config, model_dirs["drafter"], num_speculative_tokens=32)
    # 16 x 33 = 528 tokens > 512: warned, at start-up, naming the fix (a token target
    # of half the largest graph, so that a joining prompt fits beside the trees).
    with caplog.at_level("WARNING", logger="vllm.ddtree"):
        validate_ddtree_vllm_config(cfg(spec, 16))
    assert "ddtree_tokens_per_step=256" in caplog.text and "528 tokens" in caplog.text
    # 15 x 33 = 495 fits; a schedule shrinks the trees; eager has no graphs: no warning.
    assert warn_if_trees_outgrow_cuda_graphs(cfg(spec, 15)) is None
    scheduled = _spec(target_config, model_dirs["drafter"], num_speculative_tokens=32,
                      ddtree_tokens_per_step=512)
    assert warn_if_trees_outgrow_cuda_graphs(cfg(scheduled, 64)) is None
    eager = cfg(spec, 64)
    eager.model_config = types.SimpleNamespace(enforce_eager=True)
    assert warn_if_trees_outgrow_cuda_graphs(eager) is None


def _graph_config(target_config, spec, max_num_seqs=64, max_num_batched_tokens=8192, **compilation):
    cfg = _engine_config(target_config, spec, scheduler_config=SchedulerConfig(
        max_model_len=target_config.max_model_len, is_encoder_decoder=False,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        async_scheduling=True))
    cfg.compilation_config = CompilationConfig(**compilation)
    return cfg


def _derived_capture_sizes(cfg):
    """vLLM's own derivation of the capture sizes, as VllmConfig runs it right after
    the DDTree hook (patch config_ddtree-cuda-graphs-for-joining-requests)."""
    cfg.performance_mode = "throughput"
    VllmConfig._set_cudagraph_sizes(cfg)
    return cfg.compilation_config.cudagraph_capture_sizes


def test_ddtree_graphs_reach_past_a_full_step_of_trees(model_dirs, target_config):
    """A 512-token schedule fills up to 510 tokens with trees alone (30 trees of 17);
    a step that also prefills a joining request needs larger graphs than vLLM's
    default 512."""
    from vllm_ddtree.config import ddtree_cudagraph_capture_size, largest_decode_step_tokens

    spec = _spec(target_config, model_dirs["drafter"], num_speculative_tokens=64,
                 ddtree_tokens_per_step=512)
    assert largest_decode_step_tokens(spec, 64) == 510
    cfg = _graph_config(target_config, spec)
    assert ddtree_cudagraph_capture_size(cfg) == 1024  # 1020 on vLLM's 16-token steps
    sizes = _derived_capture_sizes(cfg)
    assert sizes[-1] == 1024 and 528 in sizes
    assert cfg.compilation_config.max_cudagraph_capture_size == 1024
    # Within max_num_batched_tokens.
    assert ddtree_cudagraph_capture_size(_graph_config(target_config, spec,
                                                       max_num_batched_tokens=768)) == 768


def test_ddtree_graph_default_keeps_what_vllm_or_the_user_chose(model_dirs, target_config):
    from vllm_ddtree.config import ddtree_cudagraph_capture_size

    spec = _spec(target_config, model_dirs["drafter"], num_speculative_tokens=64,
                 ddtree_tokens_per_step=512)
    # The user's sizes stand.
    given = _graph_config(target_config, spec, max_cudagraph_capture_size=256)
    assert ddtree_cudagraph_capture_size(given) is None
    assert _derived_capture_sizes(given)[-1] == 256
    assert ddtree_cudagraph_capture_size(
        _graph_config(target_config, spec, cudagraph_capture_sizes=[1, 2, 4])) is None
    # One request: twice its 65-token tree is within vLLM's default.
    assert ddtree_cudagraph_capture_size(_graph_config(target_config, spec, max_num_seqs=1)) is None
    # Drafting off from 8 requests: the largest decode step is 7 trees of 65 tokens,
    # twice that (910) rounded up to vLLM's 16-token steps above 256.
    off = _spec(target_config, model_dirs["drafter"], num_speculative_tokens=64,
                ddtree_disable_by_batch_size=8)
    assert ddtree_cudagraph_capture_size(_graph_config(target_config, off)) == 912
    # Eager engines capture nothing; other methods are not DDTree's to size.
    eager = _graph_config(target_config, spec)
    eager.model_config = types.SimpleNamespace(enforce_eager=True)
    assert ddtree_cudagraph_capture_size(eager) is None
    chain = _graph_config(target_config, types.SimpleNamespace(method="dflash"))
    assert ddtree_cudagraph_capture_size(chain) is None


def test_the_graph_default_runs_before_vllm_derives_the_capture_sizes():
    """The hook (patch config_ddtree-cuda-graphs-for-joining-requests) must come before
    VllmConfig._set_cudagraph_sizes, which turns max_cudagraph_capture_size into the
    captured sizes; VllmConfig cannot be built without a GPU platform, so its source
    is read."""
    import inspect

    source = inspect.getsource(VllmConfig.__post_init__)
    hook = source.find("ddtree_cudagraph_capture_size(self)")
    assert hook != -1, "the series is not applied to this vLLM"
    assert hook < source.find("self._set_cudagraph_sizes()")


# --- targets a tree cannot verify exactly -----------------------------------------
# Tiny hf configs of each shape through vLLM's own ModelConfig (config.json only, no
# weights), so the window, layer types and M-RoPE are what vLLM itself resolves.

_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=2048, rms_norm_eps=1e-6, torch_dtype="bfloat16")

TARGET_SHAPES = {
    # Full attention everywhere: accepted.
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                  num_hidden_layers=2, **_SMALL),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], **_qwen3_fields()),
    # Qwen3 checkpoints name a window they do not use.
    "qwen3-window-off": dict(architectures=["Qwen3ForCausalLM"], **_qwen3_fields(
        use_sliding_window=False, sliding_window=4096, max_window_layers=4)),
    # Sliding windows.
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral",
                    num_hidden_layers=2, sliding_window=64, **_SMALL),
    "qwen3-window-on": dict(architectures=["Qwen3ForCausalLM"], **_qwen3_fields(
        use_sliding_window=True, sliding_window=64, max_window_layers=4)),
    "qwen2-window-on": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                            num_hidden_layers=2, use_sliding_window=True,
                            sliding_window=64, max_window_layers=0, **_SMALL),
    "llama-layer-types": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                              num_hidden_layers=4, sliding_window=32,
                              layer_types=["sliding_attention", "full_attention"] * 2,
                              **_SMALL),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                   num_hidden_layers=6, sliding_window=32, **_SMALL),
    "gpt-oss": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss",
                    num_hidden_layers=2, sliding_window=32, num_local_experts=4,
                    num_experts_per_tok=2, **_SMALL),
    # M-RoPE.
    "qwen2.5-vl": dict(architectures=["Qwen2_5_VLForConditionalGeneration"],
                       model_type="qwen2_5_vl",
                       text_config=dict(model_type="qwen2_5_vl_text", num_hidden_layers=2,
                                        rope_scaling=dict(type="mrope",
                                                          mrope_section=[2, 3, 3]),
                                        **_SMALL),
                       vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                          num_heads=2, out_hidden_size=64),
                       vocab_size=VOCAB),
    "qwen3-vl": dict(architectures=["Qwen3VLForConditionalGeneration"], model_type="qwen3_vl",
                     text_config=dict(model_type="qwen3_vl_text", num_hidden_layers=2,
                                      rope_scaling=dict(rope_type="default",
                                                        mrope_section=[2, 3, 3],
                                                        mrope_interleaved=True),
                                      **_SMALL),
                     vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                        num_heads=2, out_hidden_size=64,
                                        deepstack_visual_indexes=[0]),
                     vocab_size=VOCAB),
}


@pytest.fixture(scope="module")
def target_shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    return {name: _write_config(root / name, **fields) for name, fields in TARGET_SHAPES.items()}


def _target(target_shapes, name, **options):
    return ModelConfig(model=target_shapes[name], skip_tokenizer_init=True, **options)


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3-window-off"])
def test_full_attention_targets_are_accepted(target_shapes, spec32, name, monkeypatch):
    from vllm_ddtree.config import target_attention_refusal

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    target = _target(target_shapes, name)
    assert target.get_sliding_window() is None
    assert target_attention_refusal(target) is None
    validate_ddtree_vllm_config(_engine_config(target, spec32))


@pytest.mark.parametrize("name, reason", [
    ("mistral", r"sliding-window attention in every layer \(sliding_window=64\)"),
    ("qwen3-window-on", r"sliding-window attention in every layer \(sliding_window=64\)"),
    ("qwen2-window-on", r"sliding-window attention in every layer \(sliding_window=64\)"),
    ("llama-layer-types", r"sliding-window attention in layers 0, 2 of 4 "
                          r"\('sliding_attention' in layer_types, sliding_window=32\)"),
    ("gemma3", r"sliding-window attention in layers 0, 1, 2, 3, 4 of 6"),
    ("gpt-oss", r"sliding-window attention in layers 0 of 2 .*attention sinks "
                r"\(gpt-oss's learned sinks in every layer\)"),
    ("qwen2.5-vl", r"M-RoPE \(rope_parameters / rope_scaling with an mrope_section\)"),
    ("qwen3-vl", r"M-RoPE \(rope_parameters / rope_scaling with an mrope_section\)"),
])
def test_targets_a_tree_cannot_verify_are_refused_naming_why(target_shapes, spec32, name,
                                                             reason, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    target = _target(target_shapes, name)
    with pytest.raises(DDTreeConfigError, match="ddtree cannot verify the target .*" + reason):
        validate_ddtree_vllm_config(_engine_config(target, spec32))


def test_disabling_the_window_makes_a_sliding_target_exact(target_shapes, spec32, monkeypatch):
    """--disable-sliding-window: vLLM attends fully and caps max_model_len at the
    window, which is what the window would have seen; gpt-oss keeps its sinks."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    mistral = _target(target_shapes, "mistral", disable_sliding_window=True)
    assert mistral.max_model_len == 64
    validate_ddtree_vllm_config(_engine_config(mistral, spec32))
    gpt_oss = _target(target_shapes, "gpt-oss", disable_sliding_window=True)
    with pytest.raises(DDTreeConfigError, match="attention sinks") as info:
        validate_ddtree_vllm_config(_engine_config(gpt_oss, spec32))
    assert "sliding" not in str(info.value)
