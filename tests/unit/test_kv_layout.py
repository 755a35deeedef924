"""The KV-layout guard DDTreeSpeculator.set_attn runs at start-up
(vllm_ddtree.kv_layout), on KV-cache configs grouped by vLLM's own
get_kv_cache_groups from vLLM's real KV-cache specs."""

import types

import pytest
import torch

pytest.importorskip("vllm")
from vllm.config import CacheConfig, SchedulerConfig  # noqa: E402
try:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups  # noqa: E402
except ImportError:  # vLLM 0.33.0: the default builder's grouping moved here
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.worker.utils import AttentionGroup  # noqa: E402

from vllm_ddtree.config import DDTreeConfigError  # noqa: E402
from vllm_ddtree.kv_layout import check_tree_kv_layout  # noqa: E402

BLOCK = 16


def _full(heads=2, head_size=16):
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head_size,
                             dtype=torch.bfloat16)


def _sliding(window=128):
    return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=16,
                             dtype=torch.bfloat16, sliding_window=window)


def _resolve_layout(vllm_config, specs) -> None:
    """0.33.0 groups by the physical KV-cache layout, which its engine core resolves
    once from the backends' supported layouts: resolve it as it does for the tree
    backend (Triton attention). 0.26.0 has no such step."""
    try:
        from vllm.v1.attention.backends.utils import (
            get_supported_kv_cache_layouts,
            resolve_kv_cache_layout,
        )
    except ImportError:
        return
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    names = [layout.name for layout in get_supported_kv_cache_layouts([TritonAttentionBackend])]
    resolve_kv_cache_layout(vllm_config, [names], dict(specs).values())


def _layout(specs, disable_hybrid=False):
    """vLLM's KV-cache groups for these per-layer specs, and the runner's attention
    groups over them (init_attn_backend's phase 1: one group per layer spec)."""
    vllm_config = types.SimpleNamespace(scheduler_config=SchedulerConfig(
        max_model_len=2048, is_encoder_decoder=False,
        disable_hybrid_kv_cache_manager=disable_hybrid),
        # Read by 0.33.0's grouping (packed layouts, HiSparse); their defaults.
        cache_config=CacheConfig(), attention_config=None, kv_transfer_config=None)
    _resolve_layout(vllm_config, specs)
    groups = get_kv_cache_groups(vllm_config, dict(specs))
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    attn_groups = []
    for gid, group in enumerate(groups):
        by_spec: dict = {}
        for name in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            by_spec.setdefault(spec, []).append(name)
        attn_groups.append([AttentionGroup(None, names, spec, gid)
                            for spec, names in by_spec.items()])
    return config, attn_groups


def _names(n, prefix="model.layers"):
    return [f"{prefix}.{i}.self_attn.attn" for i in range(n)]


def test_full_attention_target_and_drafter_share_one_group():
    # The drafter's layers differ in shape: vLLM still puts them in the target's
    # group (UniformTypeKVCacheSpecs), with one block table and one slot mapping.
    target = {name: _full() for name in _names(4)}
    drafter = {name: _full(heads=4, head_size=32) for name in _names(1, "draft.layers")}
    config, attn_groups = _layout({**target, **drafter})
    assert len(config.kv_cache_groups) == 1
    assert check_tree_kv_layout(config, attn_groups) == list(target) + list(drafter)


def test_sliding_and_full_layers_make_two_groups_and_are_refused():
    # gpt-oss-like: every other layer slides.
    specs = {name: (_sliding() if i % 2 == 0 else _full()) for i, name in enumerate(_names(4))}
    config, attn_groups = _layout(specs)
    assert len(config.kv_cache_groups) == 2
    with pytest.raises(DDTreeConfigError,
                       match="one KV-cache group, but vLLM built 2 .*SlidingWindowSpec"):
        check_tree_kv_layout(config, attn_groups)


def test_windows_folded_into_one_group_are_refused():
    # --disable-hybrid-kv-cache-manager: one group of FullAttentionSpecs, the sliding
    # layers keep their window in the spec (and in the attention kernel).
    specs = {name: (_sliding() if i % 2 == 0 else _full()) for i, name in enumerate(_names(4))}
    config, attn_groups = _layout(specs, disable_hybrid=True)
    assert len(config.kv_cache_groups) == 1
    with pytest.raises(DDTreeConfigError, match="full causal attention in every layer.*"
                       "FullAttentionSpec with sliding_window=128"):
        check_tree_kv_layout(config, attn_groups)


@pytest.mark.parametrize("spec, problem", [
    (_sliding(64), "SlidingWindowSpec"),
    (ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16,
                               dtype=torch.bfloat16, attention_chunk_size=256),
     "ChunkedLocalAttentionSpec"),
])
def test_one_group_without_full_attention_is_refused(spec, problem):
    config, attn_groups = _layout({name: spec for name in _names(3)})
    assert len(config.kv_cache_groups) == 1
    with pytest.raises(DDTreeConfigError, match=problem):
        check_tree_kv_layout(config, attn_groups)


def test_the_layer_attributes_read_are_the_ones_vllm_sets():
    """The guard also reads each built attention layer's ``sliding_window`` and
    ``has_sink`` (static_forward_context); vLLM's Attention must still set both
    (building one needs a GPU platform)."""
    import inspect

    from vllm.model_executor.layers.attention.attention import Attention

    source = inspect.getsource(Attention.__init__)
    assert "self.sliding_window = sliding_window" in source
    assert "self.has_sink = " in source


def test_the_speculator_refuses_the_layout_when_it_learns_it():
    """DDTreeSpeculator.set_attn (the runner calls it while allocating the KV cache,
    at start-up) runs the guard before anything else."""
    from vllm.config import CompilationConfig

    from vllm_ddtree.dflash_tree_drafter import DDTreeSpeculator

    specs = {name: (_sliding() if i % 2 == 0 else _full()) for i, name in enumerate(_names(4))}
    config, attn_groups = _layout(specs)
    speculator = object.__new__(DDTreeSpeculator)  # no engine: set_attn refuses first
    speculator.vllm_config = types.SimpleNamespace(compilation_config=CompilationConfig())
    with pytest.raises(DDTreeConfigError, match="one KV-cache group, but vLLM built 2"):
        speculator.set_attn(None, config, None, None, attn_groups)
