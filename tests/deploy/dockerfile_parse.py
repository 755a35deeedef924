"""A small Dockerfile reader for the tests: instructions with continuation lines joined."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

# The Python that apply.sh --site is given: the directory that holds the `vllm` package.
SITE_INVOCATION = re.compile(r"""\./apply\.sh --site "\$\(python3 -c '(?P<code>[^']+)'\)"$""")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int

    def exec_form(self) -> list[str]:
        return json.loads(self.args)


def parse(path: Path) -> list[Instruction]:
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # Docker drops comment lines inside a continued instruction
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        text = " ".join(part for part in pending if part)
        keyword, _, args = text.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
        pending = []
    assert not pending, f"{path}: the last instruction ends with a line continuation"
    return instructions


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for ins in instructions:
        if ins.keyword == "ARG" and "=" in ins.args:
            name, value = ins.args.split("=", 1)
            defaults[name] = value.strip('"')
    return defaults


def copy_sources(ins: Instruction) -> tuple[list[str], str]:
    words = [w for w in shlex.split(ins.args) if not w.startswith("--")]
    return words[:-1], words[-1]
