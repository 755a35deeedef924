"""Per-stage GPU times of DDTree decode steps, from CUDA events (opt-in).

Set ``VLLM_DDTREE_PROFILE=<path.json>`` to turn it on. The speculator then records a
CUDA event at each stage boundary of a step (no host sync: events are read only
when they have completed, a few steps later) and rewrites ``path.json`` every 50
measured steps with per-stage means and percentiles, in milliseconds of the GPU's
timeline:

    verify_forward   target forward over the trees (+ logits)   mark verify -> sample
    sample_walk      one target sample per node + the tree walk  sample -> walked
    runner_gap       the runner's bookkeeping between the two    walked -> propose
    compaction       accepted path's KV / hidden states / pos.   propose -> compacted
    draft_tree       DFlash drafter pass + best-first tree build  compacted -> drafted
                     (a step without drafts: the drafter's context store only)
    to_propose       everything before the drafter: target forward, sampling (and
                     the walk); the only forward-side stage of a step without drafts,
                     which has no sample/walked marks             verify -> propose
    step             one whole step (verify to next verify)       verify -> next verify

When the CPU falls behind, the GPU idles between events and the gap lands in the
stage that waited, so ``step`` minus the stages is host overhead. Each stage is also
timed on the host (``host_<stage>``, ``host_step``: ``time.perf_counter`` at the same
marks, i.e. when the host *issued* the work): a stage whose host time exceeds its GPU
time is bound by the host. Off (the default), it costs one environment lookup at
start-up.

Steps are grouped by their number of requests; a step that also carries prompt tokens
(a prefill or a chunk of one, beside the decodes) is grouped apart, as
``"<requests>+prefill"``: under constant concurrency a new request joins every few
steps, and those steps cost more than decode-only ones. Each group also lists
``scheduled_tokens`` (tokens the step's target forward ran: trees, decodes and prompt
chunks), so a group's cost can be read against its tokens as well as its requests.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque

import torch

from vllm_ddtree import env

MARKS = ("verify", "sample", "walked", "propose", "compacted", "drafted")
STAGES = (
    ("verify_forward", "verify", "sample"),
    ("sample_walk", "sample", "walked"),
    ("runner_gap", "walked", "propose"),
    ("compaction", "propose", "compacted"),
    ("draft_tree", "compacted", "drafted"),
    ("to_propose", "verify", "propose"),
)
ENV = env.PROFILE.name


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round((len(xs) - 1) * q / 100)))
    return xs[k]


def _group_order(group: str) -> tuple[int, str]:
    """"4" < "4+prefill" < "16": by request count, then decode-only first."""
    count, _, rest = group.partition("+")
    return int(count), rest


class StepProfiler:
    """Collects CUDA events per step; resolves them lazily without syncing."""

    def __init__(self, out_path: str, dump_every: int = 50, keep: int = 4096):
        self.out_path = out_path
        self.dump_every = dump_every
        self.keep = keep
        self.current: dict = {}
        self.pending: deque[dict] = deque()
        # step group ("16", "16+prefill") -> stage -> times in ms
        self.times: dict[str, dict[str, list[float]]] = {}
        self.measured = 0
        self.info: dict = {}
        self.clock = time.perf_counter  # seconds; replaceable in tests

    @classmethod
    def from_env(cls) -> "StepProfiler | None":
        path = env.profile_path()
        return cls(path) if path else None

    def mark(self, name: str, num_reqs: int | None = None, with_prefill: bool = False,
             num_tokens: int | None = None) -> None:
        if torch.cuda.is_current_stream_capturing():
            return
        host = self.clock()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        if name == "verify":
            # This verify event ends the previous step.
            if "verify" in self.current:
                self.current["end"] = ev
                self.current["host:end"] = host
                self.pending.append(self.current)
            self.current = {"group": f"{num_reqs or 0}{'+prefill' if with_prefill else ''}",
                            "tokens": num_tokens}
            self._resolve()
        self.current[name] = ev
        self.current["host:" + name] = host

    def _resolve(self) -> None:
        # A step is resolved once the event that ends it has completed on the GPU.
        while self.pending:
            step = self.pending[0]
            end = step["end"]
            if not end.query():
                return
            self.pending.popleft()
            times = self.times.setdefault(step["group"], {})
            for name, a, b in STAGES:
                if a in step and b in step:
                    times.setdefault(name, []).append(step[a].elapsed_time(step[b]))
                    times.setdefault("host_" + name, []).append(
                        (step["host:" + b] - step["host:" + a]) * 1e3)
            if step.get("tokens") is not None:
                # Not a time: the step's scheduled tokens, to tell whether a group's cost
                # follows its tokens or its requests.
                times.setdefault("scheduled_tokens", []).append(float(step["tokens"]))
            times.setdefault("step", []).append(step["verify"].elapsed_time(end))
            times.setdefault("host_step", []).append(
                (step["host:end"] - step["host:verify"]) * 1e3)
            self.measured += 1
            for xs in times.values():
                if len(xs) > self.keep:
                    del xs[: len(xs) - self.keep]
            if self.measured % self.dump_every == 0:
                self.dump()

    def summary(self) -> dict:
        out = {"measured_steps": self.measured, **self.info, "by_batch_size": {}}
        for group, times in sorted(self.times.items(), key=lambda kv: _group_order(kv[0])):
            out["by_batch_size"][group] = {
                name: {
                    "mean": round(sum(xs) / len(xs), 4),
                    "p50": round(_percentile(xs, 50), 4),
                    "p90": round(_percentile(xs, 90), 4),
                    "n": len(xs),
                }
                for name, xs in times.items() if xs
            }
        return out

    def dump(self) -> None:
        tmp = self.out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.summary(), f, indent=1)
        os.replace(tmp, self.out_path)
