"""What each rank verified, step by step (opt-in, for the tensor-parallel checks).

Set ``VLLM_DDTREE_RANK_TRACE=<directory>`` and every process that verifies trees (each
tensor-parallel rank) appends one line a step to ``<directory>/rank-<R>.txt``, R its
``torch.distributed`` rank (0 without one)::

    <requests> <tokens> <draft tokens> <next budget>

the step's requests, the tokens its target forward runs (roots, drafts and prompt
chunks), the draft tokens it verifies, and the budget the scheduler asked the drafter
to draft for the next step (``num_spec_tokens_to_schedule``, what the online budget
controller chose). The ranks of one engine must write the same lines: each follows the
engine core's one decision, and ranks that verified different trees would also run
different collectives. ``bench/gpu_checks.py`` compares the files after each engine
(``rank_trace``). Off (the default), it costs one environment lookup at start-up.
"""

from __future__ import annotations

import os

from vllm_ddtree import env


def process_rank() -> int:
    """This process's ``torch.distributed`` rank, 0 when there is no process group."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class RankTrace:
    """One line a verified step into this rank's file (module docstring)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._file = None

    @classmethod
    def from_env(cls) -> RankTrace | None:
        directory = env.rank_trace_dir()
        return cls(directory) if directory else None

    def record(self, num_reqs: int, num_tokens: int, num_draft_tokens: int,
               next_budget: int) -> None:
        if self._file is None:
            # Opened at the first step, when the process group exists.
            os.makedirs(self.directory, exist_ok=True)
            path = os.path.join(self.directory, f"rank-{process_rank()}.txt")
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives with the engine
        self._file.write(f"{num_reqs} {num_tokens} {num_draft_tokens} {next_budget}\n")


def compare_rank_traces(directory: str) -> dict:
    """The ranks' files of ``directory`` compared: ``ranks``, ``steps`` per rank,
    ``identical`` (every rank wrote the same lines), ``first_difference`` (step index
    or None), and over rank 0's steps the draft tokens verified and next budgets seen
    (``verified_draft_tokens``, ``next_budgets``: value -> steps)."""
    names = sorted(n for n in os.listdir(directory) if n.startswith("rank-") and n.endswith(".txt"))
    lines = {}
    for name in names:
        with open(os.path.join(directory, name)) as f:
            lines[name[len("rank-"):-len(".txt")]] = f.read().splitlines()
    result: dict = dict(ranks=sorted(lines, key=int), steps={r: len(v) for r, v in lines.items()})
    if not lines:
        return dict(result, identical=False, first_difference=None)
    traces = list(lines.values())
    first = traces[0]
    diff = None
    for other in traces[1:]:
        for i in range(max(len(first), len(other))):
            if i >= len(first) or i >= len(other) or first[i] != other[i]:
                diff = i if diff is None else min(diff, i)
                break
    drafts: dict[int, int] = {}
    budgets: dict[int, int] = {}
    for line in first:
        _, _, d, b = (int(x) for x in line.split())
        drafts[d] = drafts.get(d, 0) + 1
        budgets[b] = budgets.get(b, 0) + 1
    return dict(result, identical=diff is None and len(traces) > 1, first_difference=diff,
                verified_draft_tokens=dict(sorted(drafts.items())),
                next_budgets=dict(sorted(budgets.items())))
