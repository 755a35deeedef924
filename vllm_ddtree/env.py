"""Every ``VLLM_DDTREE_*`` environment variable, declared once (:data:`SWITCHES`: name,
type, default, what it does) and read only through the accessors below. On/off
switches share one strict parser, so a mistyped value stops the engine with the
variable's name instead of silently meaning "on". No other module of the package reads
``os.environ`` for a ``VLLM_DDTREE_`` name (tests/unit/test_env.py checks it), and
every switch has a row in docs/operations.md ("Environment variables")."""

from __future__ import annotations

import os
from dataclasses import dataclass

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switch:
    name: str
    kind: str  # "flag" (on/off), "choice" (one of ``choices``) or "path" (a file to write)
    default: bool | str | None
    doc: str
    choices: tuple[str, ...] = ()


FUSED_KERNELS = Switch(
    "VLLM_DDTREE_FUSED_KERNELS", "flag", True,
    "one Triton launch each for the tree bias, positions, walk, compaction and the "
    "store by state; 0 selects the multi-launch paths (same results), e.g. to bisect")
LEAN_DRAFT = Switch(
    "VLLM_DDTREE_LEAN_DRAFT", "flag", False,
    "the drafter computes logits and builds trees only as deep and wide as the step's "
    "budget needs (vllm_ddtree.budget.draft_shape): the batch-aware table's, or the "
    "online controller's level for the step")
CONTEXT_GRAPHS = Switch(
    "VLLM_DDTREE_CONTEXT_GRAPHS", "flag", True,
    "the drafter's context store replays CUDA graphs (vllm_ddtree.context_store_graphs); "
    "0 keeps it eager")
DEFER_CONTEXT = Switch(
    "VLLM_DDTREE_DEFER_CONTEXT", "flag", True,
    "while drafting is off, the drafter's context is buffered and stored in one pass "
    "before drafting resumes, when the requests change or the buffer fills "
    "(vllm_ddtree.deferred_context); 0 stores it every step")
DIRECT_LAUNCH = Switch(
    "VLLM_DDTREE_DIRECT_LAUNCH", "flag", True,
    "per-step kernels launch through their compiled launcher after Triton's first "
    "launch (vllm_ddtree._triton.DirectLauncher); 0 keeps Triton's launch path")
SINGLE_TOKEN_GRAPHS = Switch(
    "VLLM_DDTREE_SINGLE_TOKEN_GRAPHS", "flag", True,
    "under cudagraph_mode FULL (DDTree's default on Triton attention) also capture FULL "
    "decode graphs of one query token per request, without the tree bias, which the "
    "steps that draft nothing replay instead of the mixed graphs; 0 captures only the "
    "mixed graphs")
TREE_ATTENTION = Switch(
    "VLLM_DDTREE_TREE_ATTENTION", "choice", "triton",
    "which attention backend verifies trees: the patched Triton unified attention or "
    "the FlashAttention split (docs/tree-attention.md)", ("triton", "flash"))
PROFILE = Switch(
    "VLLM_DDTREE_PROFILE", "path", None,
    "write per-stage GPU and host times of the speculator's steps to this JSON file "
    "(vllm_ddtree.step_profile)")
COST_MODEL_REPORT = Switch(
    "VLLM_DDTREE_COST_MODEL_REPORT", "path", None,
    'write the start-up measurement of ddtree_tokens_per_step="auto" to this JSON file '
    "(vllm_ddtree.cost_model)")

BUDGET_REPORT = Switch(
    "VLLM_DDTREE_BUDGET_REPORT", "path", None,
    "rewrite the online budget controller's state (chosen budget and measured "
    "acceptance and step time per budget, by batch size) to this JSON file every 2 s "
    "of decoding (vllm_ddtree.online_budget)")

RANK_TRACE = Switch(
    "VLLM_DDTREE_RANK_TRACE", "path", None,
    "a directory: each rank appends what it verified every step (requests, tokens, draft "
    "tokens, next budget) to rank-<R>.txt there, so that tensor-parallel ranks can be "
    "shown to follow one decision (vllm_ddtree.rank_trace)")

SWITCHES: tuple[Switch, ...] = (FUSED_KERNELS, LEAN_DRAFT, CONTEXT_GRAPHS, DEFER_CONTEXT,
                                DIRECT_LAUNCH, SINGLE_TOKEN_GRAPHS, TREE_ATTENTION, PROFILE,
                                COST_MODEL_REPORT, BUDGET_REPORT, RANK_TRACE)


def known_names() -> frozenset[str]:
    """The variables of :data:`SWITCHES`: vLLM's check of the environment (patch
    ``engine_ddtree-environment-variables``) counts them as known, so setting one
    neither warns nor, with ``fail_on_environ_validation``, stops the engine."""
    return frozenset(s.name for s in SWITCHES)


def env_flag(name: str, default: bool) -> bool:
    """``name``'s value as a boolean; ``default`` when it is unset or empty."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ValueError(f"{name}={raw!r}: use 1 or 0 (or true/false, yes/no, on/off)")


def _flag(switch: Switch) -> bool:
    assert switch.kind == "flag" and isinstance(switch.default, bool)
    return env_flag(switch.name, switch.default)


def _path(switch: Switch) -> str | None:
    assert switch.kind == "path"
    return os.environ.get(switch.name) or None


def fused_kernels_enabled() -> bool:
    return _flag(FUSED_KERNELS)


def lean_draft_enabled() -> bool:
    return _flag(LEAN_DRAFT)


def context_graphs_enabled() -> bool:
    return _flag(CONTEXT_GRAPHS)


def single_token_graphs_enabled() -> bool:
    return _flag(SINGLE_TOKEN_GRAPHS)


def defer_context_enabled() -> bool:
    return _flag(DEFER_CONTEXT)


def defer_context_requested() -> bool:
    """True when the deferral is asked for by name (set on), not only by default: a
    drafter that cannot defer is then an error instead of a quiet fallback."""
    raw = os.environ.get(DEFER_CONTEXT.name)
    return raw is not None and bool(raw.strip()) and _flag(DEFER_CONTEXT)


def direct_launch_enabled() -> bool:
    return _flag(DIRECT_LAUNCH)


def tree_attention_choice() -> str:
    """``triton`` or ``flash`` (case and spaces ignored); raises ``ValueError`` naming
    the variable for anything else."""
    raw = os.environ.get(TREE_ATTENTION.name)
    value = raw.strip().lower() if raw is not None and raw.strip() else str(TREE_ATTENTION.default)
    if value not in TREE_ATTENTION.choices:
        raise ValueError(f"{TREE_ATTENTION.name}={value!r}: choose one of "
                         f"{', '.join(sorted(TREE_ATTENTION.choices))}")
    return value


def profile_path() -> str | None:
    return _path(PROFILE)


def cost_model_report_path() -> str | None:
    return _path(COST_MODEL_REPORT)


def budget_report_path() -> str | None:
    return _path(BUDGET_REPORT)


def rank_trace_dir() -> str | None:
    return _path(RANK_TRACE)
