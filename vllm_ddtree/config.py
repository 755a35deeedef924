"""Validation and resolution of ``speculative_config={"method": "ddtree", ...}``.

Two hooks in vLLM call into this module (patch ``spec-decode_ddtree-config``):

* :func:`resolve_ddtree_options` from ``SpeculativeConfig.__post_init__``, once the
  drafter's ``ModelConfig`` exists: checks the drafter and the tree options and fills
  in the defaults (depth = drafter block size - 1, top-K = min(budget, vocab)).
* :func:`validate_ddtree_vllm_config` from ``VllmConfig.__post_init__``: checks what
  needs the whole engine configuration (model runner, parallelism, the target, whose
  attention must be one a tree verifies exactly: :func:`target_attention_refusal`).

and, per request, :func:`validate_ddtree_request` from the input processor (patch
``entrypoints_refuse-per-request-what-ddtree-cannot-honour-yet``): an allowlist over
the fields of ``SamplingParams``.

Every failure raises :class:`DDTreeConfigError` (a ``ValueError``, so vLLM's
argument parsing reports it like its own) with a message naming the setting.

Options (fields of vLLM's ``SpeculativeConfig``):

``num_speculative_tokens``
    The tree budget B: draft nodes verified per request per step (the root, i.e. the
    bonus token, comes on top). The scheduler reserves B + 1 slots per request.
``ddtree_max_depth``
    Deepest tree level, at most the drafter's block size - 1 (one DFlash pass predicts
    that many positions). Default: block size - 1.
``ddtree_top_k``
    Candidates kept per drafted position before the best-first search. Default and
    maximum useful value: min(B, vocabulary size).
``ddtree_tokens_per_step``
    Optional verification-token target per forward: the budget shrinks as the batch
    grows (:mod:`vllm_ddtree.budget`), through vLLM's
    ``num_speculative_tokens_per_batch_size``, which may also be given directly.
    ``"auto"`` measures the target at start-up (:mod:`vllm_ddtree.cost_model`).
    Either needs asynchronous scheduling (the default).
``ddtree_disable_by_batch_size``
    Optional: from this many running requests on, steps decode without drafts (budget
    0), e.g. where the benchmark shows plain decoding ahead. Combines with
    ``ddtree_tokens_per_step``; needs asynchronous scheduling.
``ddtree_online_budget``
    Default on (with asynchronous scheduling and one data-parallel engine): each
    step's budget, down to 0 (no drafting), is chosen by a controller from the
    acceptance and step times the engine measures (:mod:`vllm_ddtree.online_budget`);
    the schedules above become caps by batch size. ``false``: every step verifies the
    configured budget (or schedule).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from vllm_ddtree import env

DDTREE_METHOD = "ddtree"
# A child of vLLM's logger, so its messages reach vLLM's handlers and format.
logger = logging.getLogger("vllm.ddtree")
# vLLM's default largest CUDA graph (max_cudagraph_capture_size) when not yet resolved.
DEFAULT_MAX_CUDAGRAPH_TOKENS = 512

# A tree wider than this per request cannot pay off: an H200 verification forward of
# an 8B target already doubles in cost between 256 and 512 tokens, and the tree mask
# of B+1 nodes grows as B^2 per request.
MAX_TREE_BUDGET = 512


class DDTreeConfigError(ValueError):
    """A DDTree setting that cannot work; the message names the setting."""


def _hf_get(hf_config: Any, name: str, default: Any = None) -> Any:
    value = getattr(hf_config, name, None)
    if value is None and hasattr(hf_config, "to_dict"):
        value = hf_config.to_dict().get(name)
    return default if value is None else value


def is_dflash_drafter(hf_config: Any) -> bool:
    """True when the drafter's HF config describes a DFlash (block diffusion) drafter."""
    architectures = list(_hf_get(hf_config, "architectures", []) or [])
    if any(arch.startswith("DFlash") or arch.endswith("DFlash") for arch in architectures):
        return True
    return bool(_hf_get(hf_config, "dflash_config"))


# DFlash2 drafters: DFlash's block drafter with grouped convolutions and a candidate
# head (vLLM 0.33.0's DFlash2Qwen3ForCausalLM). DDTree builds its trees from the
# candidate head's per-position logits; the pins whose vLLM serves them:
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
# Candidate-head drafters DDTree does not drive (their heads differ from DFlash2's).
UNSUPPORTED_CANDIDATE_HEADS = ("DFlash2BeamDraftModel", "LiLiCorrDraftModel")


def is_dflash2_drafter(hf_config: Any) -> bool:
    """True for a DFlash2 drafter (architecture ``DFlash2DraftModel``)."""
    return DFLASH2_ARCHITECTURE in list(_hf_get(hf_config, "architectures", []) or [])


def _check_drafter_kind(hf_config: Any, model: Any) -> None:
    """Refuse the candidate-head drafters DDTree does not drive, and DFlash2 drafters
    on a pin whose vLLM does not serve them."""
    from vllm_ddtree.reach_ins import DFLASH2_PINS, installed_pin

    architectures = list(_hf_get(hf_config, "architectures", []) or [])
    other = [a for a in architectures if a in UNSUPPORTED_CANDIDATE_HEADS]
    if other:
        raise DDTreeConfigError(
            f"ddtree: {model!r} is a {other[0]} drafter; DDTree drives DFlash "
            f"(DFlashDraftModel) and DFlash2 ({DFLASH2_ARCHITECTURE}) drafters only.")
    if is_dflash2_drafter(hf_config):
        pin = installed_pin()
        if pin not in DFLASH2_PINS:
            raise DDTreeConfigError(
                f"ddtree: {model!r} is a DFlash2 drafter ({DFLASH2_ARCHITECTURE}), which "
                f"DDTree serves on vLLM {' and '.join(DFLASH2_PINS)} only; the installed "
                f"vLLM is {pin or 'none of the pins'} (set it up with "
                f"DDTREE_VLLM={DFLASH2_PINS[-1]} ./apply.sh).")


def drafter_block_size(hf_config: Any) -> int | None:
    """Tokens one DFlash pass handles (the bonus/anchor plus the masked positions)."""
    for source in (hf_config, _hf_get(hf_config, "dflash_config", {}) or {}):
        value = source.get("block_size") if isinstance(source, dict) else _hf_get(
            source, "block_size"
        )
        if value is not None:
            return int(value)
    return None


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DDTreeConfigError(
            f"ddtree: {name} must be an integer, got {value!r} ({type(value).__name__})."
        )
    if not low <= value <= high:
        raise DDTreeConfigError(
            f"ddtree: {name}={value} is out of range; it must be between {low} and {high}."
        )
    return value


def resolve_ddtree_options(spec_config: Any) -> None:
    """Check a ``method="ddtree"`` SpeculativeConfig and fill in its defaults in place.

    ``spec_config`` is vLLM's ``SpeculativeConfig`` after its drafter ``ModelConfig``
    (``draft_model_config``) has been built.
    """
    draft_model_config = getattr(spec_config, "draft_model_config", None)
    if getattr(spec_config, "model", None) is None or draft_model_config is None:
        raise DDTreeConfigError(
            "ddtree: speculative_config needs 'model', the path of a DFlash drafter."
        )
    hf_config = draft_model_config.hf_config
    if not is_dflash_drafter(hf_config):
        architectures = _hf_get(hf_config, "architectures", [])
        raise DDTreeConfigError(
            "ddtree: the drafter must be a DFlash drafter (architecture "
            f"'DFlashDraftModel' with a dflash_config); {spec_config.model!r} has "
            f"architectures {architectures}."
        )
    _check_drafter_kind(hf_config, spec_config.model)

    budget = spec_config.num_speculative_tokens
    if budget is None:
        raise DDTreeConfigError(
            "ddtree: num_speculative_tokens (the tree budget: draft nodes verified per "
            "request per step) must be given."
        )
    _check_int("num_speculative_tokens (tree budget)", budget, 1, MAX_TREE_BUDGET)

    block_size = drafter_block_size(hf_config)
    depth = getattr(spec_config, "ddtree_max_depth", None)
    if depth is None:
        if block_size is None:
            raise DDTreeConfigError(
                "ddtree: the drafter's config has no block_size; set ddtree_max_depth "
                "(positions the drafter predicts per pass)."
            )
        depth = block_size - 1
    max_depth = block_size - 1 if block_size is not None else depth
    _check_int("ddtree_max_depth", depth, 1, max(1, max_depth))

    vocab_size = int(_hf_get(hf_config, "vocab_size", 0) or 0)
    if vocab_size <= 0:
        target = getattr(spec_config, "target_model_config", None)
        vocab_size = target.get_vocab_size() if target is not None else budget
    top_k = getattr(spec_config, "ddtree_top_k", None)
    if top_k is None:
        top_k = min(budget, vocab_size)
    _check_int("ddtree_top_k", top_k, 1, min(budget, vocab_size))

    rejection = getattr(spec_config, "rejection_sample_method", "standard")
    if rejection not in (None, "standard"):
        raise DDTreeConfigError(
            f"ddtree: rejection_sample_method={rejection!r} is not supported; DDTree "
            "verifies by walking the tree with the target's own samples (leave it "
            "'standard')."
        )
    if getattr(spec_config, "enable_adaptive_verification", False):
        # vLLM 0.33.0's field (absent on 0.26.0).
        raise DDTreeConfigError(
            "ddtree: enable_adaptive_verification=True is not supported; DDTree sizes "
            "each step's tree itself (its online budget controller, "
            "ddtree_online_budget). Leave it false."
        )
    from vllm_ddtree.budget import batch_budget_schedule
    from vllm_ddtree.cost_model import is_auto, provisional_schedule

    tokens_per_step = getattr(spec_config, "ddtree_tokens_per_step", None)
    auto = is_auto(tokens_per_step)
    if auto:
        spec_config.ddtree_tokens_per_step = tokens_per_step = "auto"
    elif tokens_per_step is not None:
        if isinstance(tokens_per_step, str):
            raise DDTreeConfigError(
                f"ddtree: ddtree_tokens_per_step must be an integer or \"auto\", got "
                f"{tokens_per_step!r}."
            )
        _check_int("ddtree_tokens_per_step", tokens_per_step, 2, 1 << 20)
    first_disabled = getattr(spec_config, "ddtree_disable_by_batch_size", None)
    if first_disabled is not None:
        _check_int("ddtree_disable_by_batch_size", first_disabled, 2, 1 << 20)
    if (tokens_per_step is not None or first_disabled is not None) and getattr(
        spec_config, "num_speculative_tokens_per_batch_size", None
    ) is not None:
        given = "ddtree_tokens_per_step" if tokens_per_step is not None \
            else "ddtree_disable_by_batch_size"
        raise DDTreeConfigError(
            f"ddtree: set either {given} or num_speculative_tokens_per_batch_size, not "
            "both (the first computes the second; give a budget-0 range in the "
            "schedule itself)."
        )
    online = getattr(spec_config, "ddtree_online_budget", None)
    if online not in (None, True, False):
        raise DDTreeConfigError(
            f"ddtree: ddtree_online_budget must be true or false, got {online!r}.")
    if auto:
        # Replaced at start-up by the measured one (vllm_ddtree.cost_model).
        spec_config.num_speculative_tokens_per_batch_size = provisional_schedule(
            budget, first_disabled
        )
    elif tokens_per_step is not None or first_disabled is not None:
        spec_config.num_speculative_tokens_per_batch_size = batch_budget_schedule(
            tokens_per_step, budget, first_disabled
        )
    elif online is not False and getattr(
            spec_config, "num_speculative_tokens_per_batch_size", None) is None:
        # The online controller (vllm_ddtree.online_budget) steers vLLM's dynamic
        # speculative decoding; with no cap given, the full budget caps every batch size.
        spec_config.num_speculative_tokens_per_batch_size = provisional_schedule(budget, None)

    spec_config.ddtree_max_depth = depth
    spec_config.ddtree_top_k = top_k


def resolve_ddtree_batch_defaults(
    spec_config: Any,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_num_scheduled_tokens: int | None,
    *,
    batched_tokens_given: bool,
    num_seqs_given: bool,
    max_model_len: int | None = None,
) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` for a DDTree engine, from the values
    vLLM's ``EngineArgs`` resolved for its usage context and GPU (patch
    ``engine_ddtree-batch-defaults``, right after vLLM fills in its defaults). The two
    flags say which of the two the user gave; ``max_num_scheduled_tokens`` is the
    user's or None. Raises DDTreeConfigError when the user's own settings cannot work.

    The DFlash drafter's query adds ``max_num_new_slots_for_drafting`` tokens per
    request (``ddtree_max_depth`` - 1) beyond the target's scheduled tokens, and vLLM
    (``VllmConfig._set_max_num_scheduled_tokens``) takes them from
    max_num_batched_tokens, for all max_num_seqs requests: scheduler budget =
    max_num_batched_tokens - slots x max_num_seqs. vLLM's server defaults on an
    H100/H200-class GPU (max_num_seqs 1024, max_num_batched_tokens 8192) leave
    8192 - 14 x 1024 = -6144 tokens, and the server does not start.

    What vLLM's users expect from its defaults is its concurrency (max_num_seqs) and
    its tokens per step (the scheduler's budget: prefill chunk size, latency) — the
    numbers its docs and benchmarks quote — not the size of the worker's buffers. So:

    * max_num_batched_tokens not given: raised by the drafter's slots (as vLLM's own
      error advises), so the scheduler keeps vLLM's tokens per step (or the user's
      max_num_scheduled_tokens) and max_num_seqs is untouched. The cost is a larger
      activation profile, hence a little less KV cache. The raise stops at
      max_num_seqs x max_model_len, the cap vLLM puts on its own default: vLLM's
      warm-up runs spread max_num_batched_tokens over max_num_seqs requests, and a
      request longer than max_model_len overruns its block table (with
      max_num_seqs 1, 2048 -> 2062 tokens at max_model_len 2048 was an illegal memory
      access at start-up). The scheduler then keeps what is left after the slots.
    * max_num_batched_tokens given, max_num_seqs not: the user chose the batch, so
      max_num_seqs is lowered until the drafter's slots take at most half of it
      (or leave the user's max_num_scheduled_tokens).
    * both given: kept; if they leave the scheduler nothing, a DDTreeConfigError
      names both and what would work.

    Each change is logged in one line naming the old and the new value.
    """
    slots = int(getattr(spec_config, "max_num_new_slots_for_drafting", 0) or 0)
    if slots <= 0:
        return max_num_batched_tokens, max_num_seqs
    reserved = slots * max_num_seqs
    why = (f"the DFlash drafter's query takes {slots} slots per request beyond the "
           "scheduled tokens (ddtree_max_depth - 1), which vLLM reserves in "
           "max_num_batched_tokens for every one of max_num_seqs requests")

    if not batched_tokens_given:
        per_step = (max_num_scheduled_tokens if max_num_scheduled_tokens is not None
                    else max_num_batched_tokens)
        wanted = per_step + reserved
        if max_model_len is not None:
            wanted = min(wanted, max_num_seqs * max_model_len)
        raised = max(max_num_batched_tokens, wanted)
        if raised - reserved < 1:
            raise DDTreeConfigError(
                f"ddtree: max_model_len={max_model_len} leaves no token a step to "
                f"schedule: {why} ({slots} x {max_num_seqs} = {reserved}), and a step "
                f"holds at most max_num_seqs x max_model_len = {raised} tokens. Set "
                f"max_model_len above {slots}.")
        if raised != max_num_batched_tokens:
            logger.info(
                "ddtree: max_num_batched_tokens %d -> %d: %s (%d x %d = %d), so that "
                "the scheduler keeps %d tokens a step and max_num_seqs=%d; set "
                "--max-num-batched-tokens to choose it yourself.",
                max_num_batched_tokens, raised, why, slots, max_num_seqs, reserved,
                raised - reserved, max_num_seqs)
        return raised, max_num_seqs

    if max_num_scheduled_tokens is not None:
        room = max_num_batched_tokens - max_num_scheduled_tokens
        kept = f"max_num_scheduled_tokens={max_num_scheduled_tokens}"
    else:
        room = max_num_batched_tokens // 2
        kept = "half of it for the scheduled tokens"
    fit = room // slots

    if not num_seqs_given:
        if fit >= max_num_seqs:
            return max_num_batched_tokens, max_num_seqs
        if fit >= 1:
            logger.info(
                "ddtree: max_num_seqs %d -> %d: %s, and max_num_batched_tokens=%d was "
                "given, so max_num_seqs is lowered to leave %s; raise "
                "--max-num-batched-tokens (or leave it unset) for more requests at once.",
                max_num_seqs, fit, why, max_num_batched_tokens, kept)
            return max_num_batched_tokens, fit

    needed = max_num_scheduled_tokens if max_num_scheduled_tokens is not None else 1
    left = max_num_batched_tokens - reserved
    if left >= needed:
        return max_num_batched_tokens, max_num_seqs
    seqs = (f"max_num_seqs={max_num_seqs}" if num_seqs_given
            else f"max_num_seqs (vLLM's default {max_num_seqs})")
    per_step = (max_num_scheduled_tokens if max_num_scheduled_tokens is not None
                else max_num_batched_tokens)
    ways = [f"max_num_batched_tokens to at least {per_step + reserved} (keeps "
            f"{per_step} tokens a step)"]
    if fit >= 1:
        ways.append(f"max_num_seqs to at most {fit} (leaves {kept})")
    raise DDTreeConfigError(
        f"ddtree: max_num_batched_tokens={max_num_batched_tokens} with {seqs} leaves "
        f"{left} tokens a step to schedule (at least {needed} needed): {why} "
        f"({slots} x {max_num_seqs} = {reserved}). Set " + " or ".join(ways)
        + ", or leave max_num_batched_tokens unset so that DDTree sizes it."
    )


def _resolve_online_budget(vllm_config: Any) -> None:
    """``ddtree_online_budget``: None (the default) becomes True where the controller
    can run (asynchronous scheduling, one data-parallel engine), else False with a log
    line; True where it cannot is an error naming why."""
    from vllm_ddtree.cost_model import provisional_schedule

    spec = vllm_config.speculative_config
    online = getattr(spec, "ddtree_online_budget", None)
    if online is False:
        return
    scheduler = vllm_config.scheduler_config
    parallel = vllm_config.parallel_config
    why = None
    if scheduler is not None and not scheduler.async_scheduling:
        why = ("needs asynchronous scheduling (with the V2 model runner only the async "
               "scheduler schedules fewer draft tokens than num_speculative_tokens)")
    elif getattr(parallel, "data_parallel_size", 1) > 1:
        why = (f"does not run with data parallelism (data_parallel_size="
               f"{parallel.data_parallel_size}): vLLM turns dynamic speculative decoding "
               "off there, since ranks choosing different budgets would diverge")
    if why is None:
        spec.ddtree_online_budget = True
        return
    if online is True:
        raise DDTreeConfigError(
            f"ddtree: ddtree_online_budget {why}; set ddtree_online_budget=false or "
            "change that setting.")
    spec.ddtree_online_budget = False
    # The full-budget cap the controller would have steered is no schedule at all.
    if (getattr(spec, "ddtree_tokens_per_step", None) is None
            and getattr(spec, "ddtree_disable_by_batch_size", None) is None
            and spec.num_speculative_tokens_per_batch_size
            == provisional_schedule(spec.num_speculative_tokens, None)):
        spec.num_speculative_tokens_per_batch_size = None
    logger.info("ddtree: the online tree budget is off: it %s; every step verifies "
                "the configured budget.", why)


def is_auto_tokens_per_step(spec_config: Any) -> bool:
    from vllm_ddtree.cost_model import is_auto

    return is_auto(getattr(spec_config, "ddtree_tokens_per_step", None))


def _v2_runner_refused_by_env() -> bool:
    from vllm_ddtree.env import FALSE_WORDS

    value = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    return value is not None and value.strip().lower() in FALSE_WORDS


def _target_supports_aux_hidden_states(model_config: Any) -> bool | None:
    """Whether the target model class returns auxiliary hidden states (the EAGLE-3
    interface DFlash drafters read). None when the class cannot be resolved here."""
    try:
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_eagle3

        model_cls, _ = ModelRegistry.resolve_model_cls(
            model_config.architectures, model_config=model_config
        )
    except Exception:  # unknown or custom architecture: the runner checks again
        return None
    return bool(supports_eagle3(model_cls))


def _layer_list(indices: list[int]) -> str:
    """``[0, 2, 4]`` -> ``"0, 2, 4"``, long lists shortened."""
    shown = ", ".join(str(i) for i in indices[:8])
    return shown + (f", ... ({len(indices)} layers)" if len(indices) > 8 else "")


# hf config fields that turn on attention sinks (a learned per-head logit added to
# every softmax) in vLLM's model classes: laguna, mimo_v2, openpangu.
_SINK_FIELDS = ("attention_sinks", "swa_attention_sink_enabled",
                "add_swa_attention_sink_bias", "param_sink_number")
# Model types whose vLLM class gives every attention layer sinks whatever the config.
_ALWAYS_SINKS = {"gpt_oss": "gpt-oss"}


def target_attention_refusal(model_config: Any) -> str | None:
    """Why the target's attention cannot be verified exactly on a tree (every reason
    found, in one message), or None.

    DDTree verifies a tree with one mask over the request's context plus its nodes,
    gives node i the position start + depth(i) and afterwards moves the accepted
    nodes' KV to consecutive slots with one slot mapping for every layer. That is
    exact for causal full attention with 1-D rotary positions only:

    * sliding windows (and chunked local attention): the tree kernels bound the
      window by a node's linear index, not its depth, and under vLLM's hybrid KV
      cache layers with a window keep their KV in a KV-cache group of their own,
      whose slot mapping the compaction does not follow;
    * attention sinks: the tree attention kernels are not checked with them;
    * M-RoPE / XD-RoPE: positions have several components, read from vLLM's M-RoPE
      position buffer, not the 1-D positions the tree rewrites.

    A window counts as in use the way vLLM decides it: ``get_sliding_window()``
    (``hf_text_config.sliding_window``; None after ``--disable-sliding-window`` or
    for a window of 0, and transformers' Qwen2/Qwen3 configs drop it when
    ``use_sliding_window`` is false) is set, and then either every layer slides
    (no ``layer_types``, or one type only: vLLM puts the window into
    ``CacheConfig.sliding_window``, which every layer without its own window
    takes) or the ``"sliding_attention"`` layers of ``layer_types`` do."""
    arch = list(getattr(model_config, "architectures", None) or [])
    hf_config = getattr(model_config, "hf_config", None)
    hf_text = getattr(model_config, "hf_text_config", None) or hf_config
    reasons: list[str] = []
    if getattr(model_config, "uses_mrope", False):
        reasons.append(
            "M-RoPE (rope_parameters / rope_scaling with an mrope_section): tree "
            "verification gives each node the 1-D position start + depth, while "
            "M-RoPE positions are 3-D (time, height, width) and are read from vLLM's "
            "M-RoPE position buffer, which the tree does not rewrite"
        )
    xdrope = getattr(model_config, "uses_xdrope_dim", 0)
    if isinstance(xdrope, int) and not isinstance(xdrope, bool) and xdrope > 0:
        reasons.append(
            "XD-RoPE (xdrope_section): tree verification rewrites only 1-D positions"
        )

    get_window = getattr(model_config, "get_sliding_window", None)
    window = get_window() if callable(get_window) else getattr(hf_text, "sliding_window", None)
    layer_types = list(getattr(hf_text, "layer_types", None) or [])
    why_window = ("tree verification bounds the window by a node's linear index, not "
                  "its depth (--disable-sliding-window, which caps max_model_len at the "
                  "window, makes vLLM attend to the whole context instead)")
    if window is not None:
        if len(set(layer_types)) > 1:  # vLLM's is_interleaved()
            sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
            if sliding:
                reasons.append(
                    f"sliding-window attention in layers {_layer_list(sliding)} of "
                    f"{len(layer_types)} ('sliding_attention' in layer_types, "
                    f"sliding_window={window}): {why_window}, and those layers keep "
                    "their KV in a KV-cache group of their own, whose slot mapping "
                    "KV compaction does not follow"
                )
        else:
            reasons.append(
                f"sliding-window attention in every layer (sliding_window={window}): "
                + why_window
            )
    chunk = getattr(hf_text, "attention_chunk_size", None)
    if chunk:
        reasons.append(
            f"chunked local attention (attention_chunk_size={chunk}): tree "
            "verification masks full causal attention only"
        )

    model_type = getattr(hf_text, "model_type", None) or getattr(hf_config, "model_type", None)
    sinks = [f"{f}={getattr(hf_text, f)!r}" for f in _SINK_FIELDS if getattr(hf_text, f, None)]
    if model_type in _ALWAYS_SINKS:
        sinks.insert(0, f"{_ALWAYS_SINKS[model_type]}'s learned sinks in every layer")
    if sinks:
        reasons.append(
            f"attention sinks ({', '.join(sinks)}): the tree attention kernels are "
            "not checked with sinks"
        )
    if not reasons:
        return None
    return (f"ddtree cannot verify the target {arch} exactly on a tree; it uses "
            + "; and ".join(reasons) + ".")


def validate_ddtree_vllm_config(vllm_config: Any) -> None:
    """Checks that need the whole engine configuration; raises DDTreeConfigError."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method != DDTREE_METHOD:
        return

    if _v2_runner_refused_by_env():
        raise DDTreeConfigError(
            "ddtree runs only on vLLM's V2 model runner, but VLLM_USE_V2_MODEL_RUNNER "
            "turns it off; unset it or set it to 1."
        )
    unsupported = vllm_config._get_v2_model_runner_unsupported_features()
    if unsupported:
        raise DDTreeConfigError(
            "ddtree runs only on vLLM's V2 model runner, which does not support: "
            + ", ".join(unsupported)
        )

    observability = getattr(vllm_config, "observability_config", None)
    if getattr(observability, "jit_monitor_mode", None) == "error":
        raise DDTreeConfigError(
            "ddtree: --jit-monitor-mode error could stop the engine at its first "
            "requests: vLLM 0.26's DFlash input kernel (_prepare_dflash_inputs_kernel, "
            "which ddtree drafts with) compiled again while serving for each new range "
            "of prompt lengths after the start-up warm-up (bench/results/"
            "2026-11-30-steady-plain-chain-trees-both-orders/); ddtree now warms it up for every block size, not yet confirmed on a "
            "GPU. Use --jit-monitor-mode warn (the default), which logs each kernel "
            "that compiles."
        )

    parallel = vllm_config.parallel_config
    if is_auto_tokens_per_step(spec) and getattr(parallel, "data_parallel_size", 1) > 1:
        raise DDTreeConfigError(
            "ddtree: ddtree_tokens_per_step=\"auto\" does not support data parallelism "
            f"(data_parallel_size={parallel.data_parallel_size}): every engine would "
            "measure its own schedule; give a number (e.g. what one engine measured)."
        )
    if parallel.pipeline_parallel_size > 1:
        raise DDTreeConfigError(
            "ddtree does not support pipeline parallelism yet "
            f"(pipeline_parallel_size={parallel.pipeline_parallel_size}); use tensor "
            "parallelism."
        )
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        raise DDTreeConfigError("ddtree does not support decode context parallelism.")

    model_config = vllm_config.model_config
    if model_config is not None:
        if getattr(model_config, "is_hybrid", False) or getattr(
            model_config, "is_attention_free", False
        ):
            raise DDTreeConfigError(
                "ddtree needs a target whose every layer is attention (tree "
                "verification masks attention); hybrid or attention-free targets such "
                f"as {model_config.architectures} are not supported."
            )
        refusal = target_attention_refusal(model_config)
        if refusal is not None:
            raise DDTreeConfigError(refusal)
        if getattr(model_config, "return_sampling_mask", False):
            # vLLM 0.33.0's field: the scheduler takes each sampled token's support
            # from the sampler's output, which the tree sampler does not produce.
            raise DDTreeConfigError(
                "ddtree does not support return_sampling_mask=True (--return-sampling-mask): "
                "the tree sampler returns no sampling masks, so answers would come without "
                "them; leave it off, or use another speculative method."
            )
        if _target_supports_aux_hidden_states(model_config) is False:
            raise DDTreeConfigError(
                "ddtree needs a target that returns auxiliary hidden states for the "
                f"DFlash drafter; {model_config.architectures} does not implement "
                "vLLM's SupportsEagle3 interface."
            )
        max_model_len = getattr(model_config, "max_model_len", None)
        if max_model_len is not None and spec.ddtree_max_depth + 2 > max_model_len:
            raise DDTreeConfigError(
                f"ddtree: max_model_len={max_model_len} is too short for trees of "
                f"depth {spec.ddtree_max_depth}."
            )

    _select_tree_attention_backend(vllm_config)

    scheduler = vllm_config.scheduler_config
    _resolve_online_budget(vllm_config)
    if getattr(spec, "num_speculative_tokens_per_batch_size", None) is not None and (
        scheduler is not None and not scheduler.async_scheduling
    ):
        raise DDTreeConfigError(
            "ddtree: a batch-size-dependent tree budget (ddtree_tokens_per_step, "
            "ddtree_disable_by_batch_size or num_speculative_tokens_per_batch_size) "
            "needs asynchronous scheduling: "
            "with the V2 model runner only the async scheduler schedules fewer draft "
            "tokens than num_speculative_tokens. Remove --no-async-scheduling (or "
            "async_scheduling=False), or drop the schedule."
        )

    tokens_per_request = spec.num_speculative_tokens + 1
    warn_if_trees_outgrow_cuda_graphs(vllm_config)
    if scheduler is not None and scheduler.max_num_batched_tokens < tokens_per_request:
        raise DDTreeConfigError(
            f"ddtree: max_num_batched_tokens={scheduler.max_num_batched_tokens} cannot "
            f"hold one request's tree ({tokens_per_request} tokens = budget + root); "
            "raise it or lower num_speculative_tokens."
        )


# The most tokens DDTree's default CUDA graphs reach (ddtree_cudagraph_capture_size).
MAX_DEFAULT_CUDAGRAPH_TOKENS = 1024


def _enforces_eager(vllm_config: Any) -> bool:
    """Whether the engine runs without CUDA graphs (``enforce_eager``)."""
    model_config = vllm_config.model_config
    return model_config is not None and bool(getattr(model_config, "enforce_eager", False))


def _ddtree_with_cuda_graphs(vllm_config: Any) -> bool:
    """A DDTree engine that captures CUDA graphs: the only kind whose graph defaults
    DDTree sets."""
    spec = vllm_config.speculative_config
    return spec is not None and spec.method == DDTREE_METHOD and not _enforces_eager(vllm_config)


def largest_decode_step_tokens(spec_config: Any, max_num_seqs: int) -> int:
    """The most tokens a decode-only step verifies: ``max_num_seqs`` full trees, or
    the largest step of the batch-size schedule."""
    schedule = getattr(spec_config, "num_speculative_tokens_per_batch_size", None)
    if not schedule:
        return (spec_config.num_speculative_tokens + 1) * max_num_seqs
    return max((budget + 1) * min(last, max_num_seqs)
               for first, last, budget in schedule if first <= max_num_seqs)


def ddtree_cudagraph_capture_size(vllm_config: Any) -> int | None:
    """DDTree's default ``max_cudagraph_capture_size``, set before vLLM derives the
    capture sizes from it (patch config_ddtree-cuda-graphs-for-joining-requests);
    returns it, or None where vLLM's own default stands.

    vLLM captures graphs up to twice a decode step but never past 512 tokens. Under
    DDTree's 512-token schedule a decode step alone reaches 512, so a step that also
    prefills a joining request ran without graphs: on the H200 benchmark pair at 64
    concurrent requests those steps, one in three, cost 23 ms (HumanEval) against
    12 ms with graphs up to 1024 tokens, and tokens/s rose from 5960 to 11700
    (bench/results/2026-11-30-steady-patch8-joining-graphs/). The default is therefore twice the largest
    decode step (rounded up to 16 tokens), at most :data:`MAX_DEFAULT_CUDAGRAPH_TOKENS`
    (capture time and memory grow with it; 2048 measured no better) and at most
    max_num_batched_tokens.
    Sizes the user gave (max_cudagraph_capture_size or cudagraph_capture_sizes) are
    kept, and eager engines have no graphs."""
    if not _ddtree_with_cuda_graphs(vllm_config):
        return None
    spec = vllm_config.speculative_config
    compilation, scheduler = vllm_config.compilation_config, vllm_config.scheduler_config
    if (compilation.max_cudagraph_capture_size is not None
            or compilation.cudagraph_capture_sizes is not None):
        return None
    # Rounded up to vLLM's 16-token steps above 256, so that the largest size is captured.
    twice = -(-2 * largest_decode_step_tokens(spec, scheduler.max_num_seqs) // 16) * 16
    size = min(twice, MAX_DEFAULT_CUDAGRAPH_TOKENS, scheduler.max_num_batched_tokens)
    if size <= DEFAULT_MAX_CUDAGRAPH_TOKENS:
        return None  # within vLLM's own default
    compilation.max_cudagraph_capture_size = size
    logger.info("ddtree: CUDA graphs captured up to %d tokens (twice the largest decode "
                "step, at most %d), so that steps prefilling a joining request beside "
                "the trees replay one; set compilation_config.max_cudagraph_capture_size "
                "to change it.", size, MAX_DEFAULT_CUDAGRAPH_TOKENS)
    return size


def ddtree_cudagraph_mode(vllm_config: Any, level_default: Any) -> Any | None:
    """DDTree's default ``cudagraph_mode``, set before vLLM applies its optimization
    level's defaults (patch config_ddtree-cuda-graphs-for-joining-requests); returns
    it, or None where the user's or vLLM's own mode stands.

    vLLM's default FULL_AND_PIECEWISE replays whole-forward (FULL) graphs for uniform
    decode steps only; a step that also prefills a joining request replays piecewise
    graphs, between which the host launches every layer's attention. With trees on
    Triton attention that host work made such a forward cost 7.6 ms (1.9 ms for a
    decode step of about the same tokens; 2.1 ms for the same step in one FULL graph;
    H200 benchmark pair, 64 concurrent requests), and under constant concurrency about
    one step in three admits a request. Triton's unified attention runs any mix of
    prefills and trees inside one graph (its CUDA graph support is ALWAYS), so DDTree
    on it defaults to FULL: one graph per token count for every step up to the largest
    captured size (bench/results/2026-11-30-steady-varied-lengths-full-graphs/). Kept: a mode the user set, levels
    whose default has no FULL graphs (O0, O1), eager engines, and trees verified on
    FlashAttention (``VLLM_DDTREE_TREE_ATTENTION=flash``, whose split is measured with
    decode-only FULL graphs)."""
    from vllm.config.compilation import CUDAGraphMode

    if not _ddtree_with_cuda_graphs(vllm_config):
        return None
    compilation = vllm_config.compilation_config
    if compilation.cudagraph_mode is not None:
        return None  # the user's
    if level_default != CUDAGraphMode.FULL_AND_PIECEWISE:
        return None
    if tree_attention_backend() != TREE_ATTENTION_BACKENDS["triton"]:
        return None
    compilation.cudagraph_mode = CUDAGraphMode.FULL
    logger.info("ddtree: cudagraph_mode FULL, so that steps prefilling a joining request "
                "beside the trees replay one whole-forward graph instead of piecewise "
                "graphs; set compilation_config.cudagraph_mode to change it.")
    return CUDAGraphMode.FULL


def warn_if_trees_outgrow_cuda_graphs(vllm_config: Any) -> str | None:
    """Warn (and return the message) when a full batch of full trees verifies more
    tokens per forward than the largest CUDA graph and no batch-size schedule shrinks
    the trees: those steps run without graphs. On the H200 that made the benchmark
    pair's verification forward ~10x slower (docs/benchmarks.md: 1.5 -> 15.5 ms at
    batch 16 with B=32). Not an error: the output stays right, and a user may want
    the full tree at every batch size."""
    spec = vllm_config.speculative_config
    scheduler = vllm_config.scheduler_config
    if scheduler is None or getattr(spec, "num_speculative_tokens_per_batch_size", None):
        return None
    if _enforces_eager(vllm_config):
        return None
    compilation = getattr(vllm_config, "compilation_config", None)
    cap = getattr(compilation, "max_cudagraph_capture_size", None) or DEFAULT_MAX_CUDAGRAPH_TOKENS
    worst = largest_decode_step_tokens(spec, scheduler.max_num_seqs)  # no schedule here
    if worst <= cap:
        return None
    message = (
        f"ddtree: with num_speculative_tokens={spec.num_speculative_tokens} and "
        f"max_num_seqs={scheduler.max_num_seqs} a step can verify {worst} tokens, more "
        f"than the largest CUDA graph ({cap} tokens); such steps run without CUDA graphs "
        f"and their forward costs several times more. Set ddtree_tokens_per_step={cap // 2} "
        "(half the largest graph, leaving room for a joining request's prompt; or lower, "
        "near your target's knee) to shrink the trees as the batch grows, or lower "
        "max_num_seqs (docs/operations.md, 'Choosing the budget')."
    )
    logger.warning(message)
    return message


# Which backend verifies trees: the patched Triton unified attention (default), or
# FlashAttention with the context / tree-suffix split (opt-in, route 2 of
# docs/tree-attention.md).
TREE_ATTENTION_ENV = env.TREE_ATTENTION.name
TREE_ATTENTION_BACKENDS = {"triton": "TRITON_ATTN", "flash": "FLASH_ATTN"}
TREE_ATTENTION_BACKEND = TREE_ATTENTION_BACKENDS["triton"]


def tree_attention_backend() -> str:
    """The attention backend name DDTree verifies trees with (from the environment)."""
    try:
        return TREE_ATTENTION_BACKENDS[env.tree_attention_choice()]
    except ValueError as exc:
        raise DDTreeConfigError(str(exc)) from None


def _select_tree_attention_backend(vllm_config: Any) -> None:
    """Tree verification needs a backend that applies per-request tree masks: the
    patched Triton unified attention, or (``VLLM_DDTREE_TREE_ATTENTION=flash``) the
    patched FlashAttention split. Pick it unless the user chose a backend, which
    must then be that one."""
    attention_config = getattr(vllm_config, "attention_config", None)
    if attention_config is None:
        return
    wanted = tree_attention_backend()
    chosen = attention_config.backend
    if chosen is None:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        attention_config.backend = AttentionBackendEnum[wanted]
    elif (name := getattr(chosen, "name", str(chosen))) != wanted:
        hint = (
            f" (FLASH_ATTN verifies trees with {TREE_ATTENTION_ENV}=flash)"
            if name == "FLASH_ATTN" else ""
        )
        raise DDTreeConfigError(
            f"ddtree verifies trees with the {wanted} attention backend "
            f"(per-request tree masks); attention backend {name} cannot apply "
            f"them{hint}. Leave the backend unset or choose {wanted}."
        )
    if wanted == "FLASH_ATTN":
        validate_flash_tree_attention(vllm_config)


# The tree kernel of the FlashAttention split holds a (B+1)^2 score tile per program.
FLASH_TREE_MAX_BUDGET = 127


def validate_flash_tree_attention(vllm_config: Any) -> None:
    """What the FlashAttention tree split does not cover, refused at start-up."""
    spec = getattr(vllm_config, "speculative_config", None)
    budget = getattr(spec, "num_speculative_tokens", None)
    if isinstance(budget, int) and budget > FLASH_TREE_MAX_BUDGET:
        raise DDTreeConfigError(
            f"ddtree with {TREE_ATTENTION_ENV}=flash verifies trees of at most "
            f"{FLASH_TREE_MAX_BUDGET} nodes; num_speculative_tokens={budget}."
        )
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    if cache_dtype.startswith("fp8"):
        raise DDTreeConfigError(
            f"ddtree with {TREE_ATTENTION_ENV}=flash needs an unquantized KV cache "
            f"(kv_cache_dtype={cache_dtype}): the tree part reads this step's K/V "
            "unquantized while the context part reads the cache."
        )
    parallel = getattr(vllm_config, "parallel_config", None)
    dcp = getattr(parallel, "decode_context_parallel_size", 1) or 1
    if dcp > 1:
        raise DDTreeConfigError(
            f"ddtree with {TREE_ATTENTION_ENV}=flash does not support decode context "
            f"parallelism (decode_context_parallel_size={dcp})."
        )
    model_config = getattr(vllm_config, "model_config", None)
    dtype = getattr(model_config, "dtype", None)
    if dtype is not None and str(dtype).removeprefix("torch.") not in ("float16", "bfloat16"):
        raise DDTreeConfigError(
            f"ddtree with {TREE_ATTENTION_ENV}=flash needs a float16 or bfloat16 model "
            f"(dtype={str(dtype).removeprefix('torch.')}): FlashAttention has no kernels "
            "for it; use the default Triton tree attention."
        )
    hf_config = getattr(model_config, "hf_text_config", None)
    for field in ("sliding_window", "attn_logit_softcapping"):
        value = getattr(hf_config, field, None)
        if value and not (field == "sliding_window"
                          and not getattr(hf_config, "use_sliding_window", True)):
            raise DDTreeConfigError(
                f"ddtree with {TREE_ATTENTION_ENV}=flash does not support targets with "
                f"{field}={value}; use the default Triton tree attention."
            )


# Every field of vLLM 0.26.0's SamplingParams, in one of three lists; a field in
# none (a new upstream field) is refused unless it has its default, and
# tests/unit/test_ddtree_requests.py fails until it is classified.
#
# Exact on a tree: the tree sampler (vllm_ddtree.tree_verifier.DDTreeSampler) takes
# one sample per node with vLLM's V2 sampler, whose per-row steps are logit bias
# (logit_bias, allowed_token_ids, min_tokens), penalties, bad words, temperature,
# min-p, top-k/top-p and the Gumbel draw keyed by seed and position. The bias
# depends on the position only, and a node at depth d is sampled at position
# start + d, as plain decoding samples that token; the rest below acts on the
# accepted tokens after the walk (the scheduler's stop checks, one token at a
# time; the detokenizer) or on the engine around the request.
TREE_EXACT_REQUEST_FIELDS = {
    "n": "each of the n samples is a request of its own in the engine",
    "temperature": "per logit row",
    "top_p": "per logit row",
    "top_k": "per logit row",
    "min_p": "per logit row",
    "seed": "the Gumbel noise is keyed by seed and position (start + depth)",
    "logit_bias": "per logit row, the same at every position",
    "allowed_token_ids": "per logit row, the same at every position",
    "min_tokens": "keyed by position (start + depth), like plain decoding",
    "max_tokens": "the scheduler caps the accepted tokens",
    "stop": "stop strings: the detokenizer, on accepted tokens",
    "stop_token_ids": "the scheduler's stop check, on accepted tokens one at a time",
    "ignore_eos": "the scheduler's stop check",
    "include_stop_str_in_output": "output processing",
    "output_text_buffer_length": "output processing (derived from stop)",
    "detokenize": "output processing",
    "skip_special_tokens": "output processing",
    "spaces_between_special_tokens": "output processing",
    "output_kind": "output processing",
    "skip_clone": "how the engine copies the parameters",
    "repetition_detection": "the scheduler's stop check, on accepted tokens",
    "skip_reading_prefix_cache": "the scheduler's prefix cache",
    "flat_logprobs": "only the format of logprobs",
    "logprobs": "the tree sampler scores each emitted token at the node it was sampled "
                "from, with vLLM's compute_topk_scores (DDTreeSampler._path_logprobs)",
    "logprob_token_ids": "the same, for the requested token ids",
    "prompt_logprobs": "computed by vLLM's prompt-logprobs worker over a prefilling "
                       "request's rows, which carry no tree (a tree's positions and "
                       "bias are a decoding request's)",
    "extra_args": "read by no in-tree sampler; custom logits processors, which "
                  "could read it, stop the V2 runner at start-up",
    "routed_experts_prompt_start": "routed-experts capture stops the V2 runner at "
                                   "start-up",
    "_eos_token_id": "the scheduler's stop check and min_tokens",
    "_all_stop_token_ids": "the scheduler's stop check and min_tokens",
    # vLLM 0.33.0's fields (absent on 0.26.0):
    "stream_interval": "output processing (tokens batched per streamed output)",
    "watermarking": "vLLM refuses a watermark configuration with method ddtree at "
                    "start-up, so, as in any engine without one, the request runs "
                    "unwatermarked",
    "_watermarking_skipped": "set by the input processor after this check; request "
                             "statistics only",
}
# Exact without drafts: these read the tokens before the sampled one (penalties and bad
# words count the request's tokens plus a chain's earlier drafts; a grammar mask follows
# the accepted tokens), which on a tree would include a node's siblings. A request that
# sets any of them is decoded without drafts (vLLM's scheduler gives it no draft slots,
# patch core_ddtree-requests-without-drafts: its own budget 0 while the other requests
# keep their trees), so each step samples its one row as decoding without speculation
# does: the same logits processing over the same tokens, the grammar bitmask vLLM
# computes for a request without drafts.
TREE_WITHOUT_DRAFTS_REQUEST_FIELDS = {
    "presence_penalty": "penalties count the tokens before the sampled one",
    "frequency_penalty": "penalties count the tokens before the sampled one",
    "repetition_penalty": "penalties count the tokens before the sampled one",
    "bad_words": "bad words match the tokens before the sampled one",
    "_bad_words_token_ids": "bad words match the tokens before the sampled one",
    "structured_outputs": "the grammar follows the accepted tokens (response_format "
                          "json_object / json_schema, structural tags, guided decoding, "
                          "tool_choice required or named)",
}
# Refused unless at their default, with the reason the refusal names.
TREE_REFUSED_REQUEST_FIELDS = {
    "thinking_token_budget": "not supported by vLLM's V2 model runner, which DDTree "
                             "runs on",
    # vLLM 0.33.0's fields (absent on 0.26.0):
    "prompt_logprob_token_ids": "prompt logprobs (of given token ids) are not checked "
                                "against decoding without speculation yet",
    "prompt_logprob_start": "it selects the prompt rows of prompt_logprob_token_ids, "
                            "which is refused",
    "trace_decode_token_ids": "the tree sampler does not replay a forced token trace "
                              "(vLLM's sampler applies it after sampling; the tree walk "
                              "would ignore it)",
}


def sampling_param_fields(cls: type) -> tuple[str, ...]:
    """The fields of vLLM's ``SamplingParams`` (a msgspec struct; a dataclass in
    other releases)."""
    fields = getattr(cls, "__struct_fields__", None)
    if fields is None:
        import dataclasses

        fields = tuple(f.name for f in dataclasses.fields(cls))
    return tuple(fields)


@functools.lru_cache(maxsize=4)
def _default_params(cls: type) -> Any:
    return cls()


def _is_unset(value: Any) -> bool:
    return value is None or (isinstance(value, (list, tuple, dict, set)) and not value)


def _is_default(value: Any, default: Any) -> bool:
    """Whether a request field is at its default; ``None`` and an empty container
    both mean unset (SamplingParams turns ``bad_words=None`` into ``[]``)."""
    if value is None or default is None:
        return _is_unset(value) and _is_unset(default)
    return bool(value == default)


def decode_without_drafts(params: Any) -> bool:
    """Whether a request sets any of :data:`TREE_WITHOUT_DRAFTS_REQUEST_FIELDS` (it is
    then decoded without drafts)."""
    if params is None:
        return False
    defaults = _default_params(type(params))
    return any(not _is_default(getattr(params, name, None), getattr(defaults, name, None))
               for name in TREE_WITHOUT_DRAFTS_REQUEST_FIELDS)


_logged_without_drafts = False


def mark_request_without_drafts(request: Any) -> None:
    """Scheduler hook (patch core_ddtree-requests-without-drafts), once per new request:
    ``request.ddtree_no_drafts``, which makes the scheduler give it no draft slots.
    The first such request of an engine is logged."""
    global _logged_without_drafts
    request.ddtree_no_drafts = decode_without_drafts(getattr(request, "sampling_params", None))
    if request.ddtree_no_drafts and not _logged_without_drafts:
        _logged_without_drafts = True
        logger.info(
            "ddtree: requests that set penalties, bad words or structured outputs are "
            "decoded without drafts (exact; the other requests keep their trees). If "
            "every request is, the model's generation_config.json may set a penalty: "
            "--override-generation-config '{\"repetition_penalty\": 1.0}'.")


def validate_ddtree_request(params: Any) -> None:
    """Refuse, per request, what DDTree cannot serve exactly (HTTP 400 in the OpenAI
    server: vLLM turns this ValueError into a bad-request error).

    An allowlist over every field of ``SamplingParams``: a field in
    :data:`TREE_EXACT_REQUEST_FIELDS` or :data:`TREE_WITHOUT_DRAFTS_REQUEST_FIELDS`
    may take any value; any other field, those of :data:`TREE_REFUSED_REQUEST_FIELDS`
    and fields not classified yet, only its default. The message names every refused
    field."""
    defaults = _default_params(type(params))
    refused = []
    for name in sampling_param_fields(type(params)):
        if name in TREE_EXACT_REQUEST_FIELDS or name in TREE_WITHOUT_DRAFTS_REQUEST_FIELDS:
            continue
        if _is_default(getattr(params, name, None), getattr(defaults, name, None)):
            continue
        reason = TREE_REFUSED_REQUEST_FIELDS.get(
            name, "a sampling parameter DDTree does not know yet")
        refused.append(f"{name} ({reason})")
    if refused:
        raise ValueError(
            "this server decodes with DDTree speculative decoding, which does not "
            "support " + "; ".join(refused) + " yet; leave them unset."
        )
