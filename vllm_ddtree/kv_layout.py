"""The target KV-cache layout that tree verification and KV compaction assume,
checked when the speculator learns it (:meth:`DDTreeSpeculator.set_attn`, while the
engine allocates its KV cache at start-up, before any request).

KV compaction moves every compacted layer's accepted-node KV with the slot mapping
of the first attention layer, and the tree mask is one causal mask over the whole
context. Both hold only when all those layers sit in one KV-cache group (one block
table, hence one slot mapping) and attend fully: no sliding window, no chunked
local attention, no sink tokens or learned sinks. The start-up check of the target's
config (:func:`vllm_ddtree.config.target_attention_refusal`) refuses the known
shapes; this one reads what vLLM actually built, so a model whose window comes from
a setting that check does not know is refused here too, instead of serving wrong
tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_ddtree.config import DDTreeConfigError


def _spec_problem(spec: Any) -> str | None:
    """What in one layer's KV-cache spec a tree cannot follow, or None."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SinkFullAttentionSpec

    if not isinstance(spec, FullAttentionSpec):
        return type(spec).__name__
    if isinstance(spec, SinkFullAttentionSpec):
        return f"{type(spec).__name__} (sink_len={spec.sink_len})"
    if spec.sliding_window is not None:
        return f"{type(spec).__name__} with sliding_window={spec.sliding_window}"
    if spec.attention_chunk_size is not None:
        return f"{type(spec).__name__} with attention_chunk_size={spec.attention_chunk_size}"
    return None


def _layer_problem(layer: Any) -> str | None:
    """What in a built attention layer a tree cannot follow, or None."""
    window = getattr(layer, "sliding_window", None)
    if window is not None:
        return f"sliding_window={window}"
    if getattr(layer, "has_sink", False):
        return "attention sinks"
    return None


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f", ... ({len(names)} layers)" if len(names) > 3 else "")


def check_tree_kv_layout(
    kv_cache_config: Any,
    attn_groups: list[list[Any]],
    layers: Mapping[str, Any] | None = None,
) -> list[str]:
    """The names of the layers whose KV compaction moves (every layer of
    ``attn_groups``, the runner's attention groups, in order), after checking that
    they share one KV-cache group of full attention.

    ``kv_cache_config`` is vLLM's ``KVCacheConfig``, ``attn_groups`` the model
    runner's ``AttentionGroup`` lists (one list per KV-cache group), ``layers`` the
    attention layers by name (``compilation_config.static_forward_context``), read
    for per-layer windows and sinks. Raises :class:`DDTreeConfigError`."""
    groups = [g for g in kv_cache_config.kv_cache_groups if g.layer_names]
    if len(groups) > 1:
        shown = "; ".join(
            f"group {i}: {type(g.kv_cache_spec).__name__} for {_names(list(g.layer_names))}"
            for i, g in enumerate(groups)
        )
        raise DDTreeConfigError(
            f"ddtree needs every attention layer in one KV-cache group, but vLLM built "
            f"{len(groups)} ({shown}): KV compaction moves all layers' accepted KV with "
            "one slot mapping and the tree mask is one full causal mask. Layers with a "
            "sliding window or another attention type (or a drafter whose layers "
            "differ) make such groups; such targets are not supported."
        )
    names: list[str] = []
    problems: list[str] = []
    group_ids = set()
    for per_group in attn_groups:
        for group in per_group:
            if not group.layer_names:
                continue
            group_ids.add(group.kv_cache_group_id)
            problem = _spec_problem(group.kv_cache_spec)
            if problem is not None:
                problems.append(f"{_names(list(group.layer_names))}: {problem}")
            for name in group.layer_names:
                names.append(name)
                layer = layers.get(name) if layers is not None else None
                problem = _layer_problem(layer) if layer is not None else None
                if problem is not None:
                    problems.append(f"{name}: {problem}")
    if len(group_ids) > 1:
        raise DDTreeConfigError(
            f"ddtree needs every attention layer in one KV-cache group; the attention "
            f"groups span KV-cache groups {sorted(group_ids)}, whose slot mappings "
            "differ: KV compaction moves all layers' accepted KV with one slot mapping."
        )
    if problems:
        raise DDTreeConfigError(
            "ddtree needs full causal attention in every layer (one tree mask, one "
            "slot mapping for KV compaction); these layers differ: "
            + "; ".join(problems[:6])
            + (f"; ... ({len(problems)} in all)" if len(problems) > 6 else "")
            + "."
        )
    if not names:
        raise DDTreeConfigError("ddtree: the target has no attention layers with a KV cache.")
    return names
