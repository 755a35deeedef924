"""On/off switches read from the environment (``VLLM_DDTREE_*``): one strict parser,
so a mistyped value stops the engine with the variable's name instead of silently
meaning "on"."""

from __future__ import annotations

import os

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


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
