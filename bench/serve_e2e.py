"""End-to-end check of the OpenAI-compatible server with DDTree speculative decoding.

Run once on a GPU host (no internet), e.g.::

    PYTHONPATH=.:/opt/vllm-site python3 bench/serve_e2e.py \\
        --target /opt/smollm2-hf --drafter bench/fixture/smollm2-dflash \\
        --out $OUT/serve-e2e.json --log-dir $OUT

Phases, each bounded by the overall ``--time-budget`` (a watchdog thread kills every
process this script started and writes what it has if the budget is overrun):

1. ``bad_configs``: ``vllm serve`` with two invalid DDTree speculative configs must exit
   non-zero quickly with a message naming the setting (they fail in config validation,
   before any GPU work).
   ``server_defaults`` (``--server-defaults``): ``vllm serve TARGET --speculative-config``
   with no other flag, as the docs start it (vLLM's defaults: port 8000, its memory
   share, concurrency and tokens per step, CUDA graphs): healthy, a completion, a chat
   completion and ``--concurrency`` streamed requests without an error; DDTree's log
   lines about the defaults it changed are recorded.
   ``server_entrypoint`` (``--server-entrypoint ENV_FILE``): the same checks on the
   server the image's entrypoint (``deploy/entrypoint.sh``) starts from a Kubernetes env
   file's variables (``deploy/k8s/base/ddtree.env``), as the shipped deployment does;
   the ``vllm serve`` line it built is recorded.
2. ``startup``: the real server (DDTree, budget ``--budget``) until ``/health`` is 200.
3. ``endpoints``: /health, /v1/models, completions and chat completions, each
   non-streamed and streamed (streamed text must equal non-streamed text at T=0), and
   the ``vllm:spec_decode*`` Prometheus counters (mean acceptance length
   = 1 + accepted / drafts).
4. ``bad_requests``: what speculative decoding refuses per request (logit_bias) and
   plain bad requests get a 4xx with a message; the server stays healthy.
   ``features``: what DDTree serves (logprobs, prompt logprobs; penalties, bad words and
   a JSON schema, without drafts), each at T=0 and at T=1 with a seed, streamed and not, sent at once:
   a 200 with the logprobs asked for, the schema's answers parse as JSON with its
   required field (and the chat route's ``response_format``). Phase 6 replays them
   without speculation (``features_vs_no_spec``: tokens and logprobs; a failure only
   with ``--strict-greedy``).
5. ``load``: ``--num-requests`` streamed greedy completions (``ignore_eos``) from
   ``--concurrency`` concurrent clients; zero errors required; latency percentiles and
   output tokens/s recorded, token ids kept (``return_token_ids``).
   ``feature_load``: ``--feature-load`` requests cycling through the feature settings
   (streamed and not, T=0 and seeded T=1, each on another prompt) at ``--concurrency``;
   each must be answered as asked; in phase 6 compared with plain decoding offline
   (``feature_load_vs_no_spec``; a failure only with ``--strict-greedy``).
   ``plain_server`` (``--plain-server``): the server is stopped and vLLM's server
   without speculation started with the same flags; it gets the same feature requests
   and load, and its answers are compared with the DDTree server's
   (``plain_server.features_vs_ddtree``, ``greedy_vs_ddtree``; failures only with
   ``--strict-greedy``) and, in phase 6, with decoding without speculation offline
   (``greedy_vs_offline_no_spec``: the control for how far batching alone moves plain
   decoding).
6. ``offline``: after the server is stopped, the same prompts (the server's prompt
   token ids) through ``vllm.LLM``, greedy outputs compared token for token with the
   server's, against two references (``--offline-references``): ``no-spec``, decoding
   without speculation (DDTree is lossless, so only rounding may separate them), and
   ``same-config``, the server's own DDTree configuration offline with all prompts at
   once (what the server adds: scheduling under load, streaming, HTTP). Each runs in a
   child process of this script (``--offline-worker``) so that its wait is bounded and
   the parent never initialises CUDA. Where two greedy outputs differ (the DDTree
   server against plain decoding offline, against the plain server, against its own
   configuration offline; the plain server against plain decoding offline), the
   ``no-spec`` worker recomputes the first differing position with plain decoding and
   both tokens' logprobs (``margins``): a near tie (``|gap| <= NEAR_TIE_LOGPROB_GAP``,
   the bound ``bench/gpu_checks.py near_tie_margins`` uses) is rounding, a larger gap a
   token plain decoding could not have chosen. A mismatch is reported; with
   ``--strict-greedy`` a mismatch that is not a near tie is a failure.

Everything goes to ``--out`` (JSON); server output goes to ``--log-dir``. Exit status:
0 when every hard check passed, 1 otherwise, 2 when the watchdog fired.

The HTTP client side uses only the standard library (urllib) for the sequential checks
and aiohttp for the concurrent load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

# Run as a file (python bench/serve_e2e.py): make `bench` importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.stats import percentile  # noqa: E402

SERVED_MODEL_NAME = "smollm2"
SERVER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
# What the image sets for its entrypoint (Dockerfile `ENV`) that a server reads; its
# paths (HOME, caches) are the image's user's and are left to this host.
IMAGE_ENV = {"VLLM_NO_USAGE_STATS": "1", "PORT": "8000"}
# The module behind the `vllm` console script in vLLM 0.26.0.
DEFAULT_SERVER_PREFIX = ("{python}", "-m", "vllm.entrypoints.cli.main")
# Extra seconds the watchdog allows past --time-budget (phases are already cut to the
# budget; this covers stopping processes). The variable exists for the tests.
WATCHDOG_GRACE_S = float(os.environ.get("SERVE_E2E_WATCHDOG_GRACE_S", "60"))

# --------------------------------------------------------------------------- prompts
_TEMPLATES = (
    "Write a short paragraph explaining {}.",
    "Here are three interesting facts about {}:\n1.",
    "Q: What is the most important thing to know about {}?\nA:",
    "Explain {} to a ten-year-old child.",
)
_SUBJECTS = (
    "photosynthesis", "the French Revolution", "black holes", "the water cycle",
    "machine learning", "the Roman Empire", "volcanoes", "the stock market",
    "honey bees", "the internet", "climate change", "the human heart",
    "electric cars", "the Moon landing", "coffee", "the printing press",
    "earthquakes", "vaccines", "the Great Wall of China", "rainbows",
    "compound interest", "the Olympic Games", "DNA", "penguins",
)
_CODE_PROMPTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "def is_prime(n: int) -> bool:\n",
    "# Python function that reverses a linked list\ndef reverse_list(head):\n",
    "def merge_sort(items):\n    \"\"\"Sort a list with merge sort.\"\"\"\n",
    "def binary_search(arr, target):\n",
    "// JavaScript: debounce a function\nfunction debounce(fn, ms) {\n",
    "def count_words(text: str) -> dict[str, int]:\n",
    "import json\n\ndef load_config(path):\n",
    "class Stack:\n    \"\"\"A simple LIFO stack.\"\"\"\n\n    def __init__(self):\n",
    "SELECT name, COUNT(*) AS orders\nFROM customers\n",
    "def flatten(nested):\n    \"\"\"Flatten a nested list.\"\"\"\n",
    "#include <stdio.h>\n\nint main(void) {\n",
    "def gcd(a, b):\n",
    "def quicksort(xs):\n",
    "def parse_csv_line(line):\n",
    "fn factorial(n: u64) -> u64 {\n",
)


def builtin_prompts() -> list[str]:
    """Distinct English and code prompts: 4 templates x 24 subjects + 16 code = 112,
    plus numbered variants of the code prompts when more are asked for."""
    prompts = [t.format(s) for s in _SUBJECTS for t in _TEMPLATES]
    prompts += list(_CODE_PROMPTS)
    return prompts


def select_prompts(n: int, prompts_file: str | None = None) -> tuple[list[str], str]:
    """``n`` prompts, distinct where possible: from a JSONL file (keys
    ``completion_prompt``, ``prompt`` or ``text``, first found) or the built-in set.
    When the source has fewer distinct prompts, a numbered prefix keeps them distinct."""
    if prompts_file:
        base, source = [], f"file:{prompts_file}"
        with open(prompts_file) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                row = json.loads(line)
                text = row if isinstance(row, str) else next(
                    (row[k] for k in ("completion_prompt", "prompt", "text") if row.get(k)), None
                )
                if text and text not in base:
                    base.append(text)
        if not base:
            raise ValueError(f"no prompts in {prompts_file}")
    else:
        base, source = builtin_prompts(), "builtin"
    out = []
    for i in range(n):
        text = base[i % len(base)]
        if i >= len(base):
            text = f"Example {i // len(base)}.\n{text}"
        out.append(text)
    return out, source


# --------------------------------------------------------------------------- pure helpers
class SSEParser:
    """Incremental parser of a server-sent-event stream as the OpenAI API sends it.

    ``feed(bytes)`` returns the payloads completed by those bytes: decoded JSON objects
    for ``data: {...}`` lines, and the string ``"[DONE]"`` for the terminator. Lines may
    be split anywhere across chunks; CRLF and LF endings, comments (``:``) and other
    fields (``event:``, ``id:``) are accepted and skipped. A ``data:`` line that is not
    JSON is returned as ``{"_unparsed": text}`` so that the caller can count it as an
    error instead of losing it.
    """

    def __init__(self) -> None:
        self._buf = b""
        self.done = False

    def feed(self, chunk: bytes) -> list[Any]:
        self._buf += chunk
        events = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                break
            raw, self._buf = self._buf[:nl], self._buf[nl + 1:]
            event = self._line(raw.rstrip(b"\r").decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[Any]:
        """Payload of a last line that had no newline, if any."""
        rest, self._buf = self._buf, b""
        event = self._line(rest.rstrip(b"\r").decode("utf-8", errors="replace"))
        return [event] if event is not None else []

    def _line(self, line: str) -> Any:
        if not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if not data:
            return None
        if data == "[DONE]":
            self.done = True
            return "[DONE]"
        try:
            return json.loads(data)
        except json.JSONDecodeError:
            return {"_unparsed": data}


def latency_summary(latencies: list[float]) -> dict:
    if not latencies:
        return {"count": 0}
    return {
        "count": len(latencies),
        "mean_s": round(sum(latencies) / len(latencies), 4),
        "p50_s": round(percentile(latencies, 50), 4),
        "p90_s": round(percentile(latencies, 90), 4),
        "p99_s": round(percentile(latencies, 99), 4),
        "max_s": round(max(latencies), 4),
    }


def parse_prometheus(text: str, prefix: str = "") -> tuple[list[str], dict[str, float]]:
    """Sample lines starting with ``prefix`` and, per metric name, the sum of their
    values over all label sets (``_created`` timestamps are skipped in the sums)."""
    lines, sums = [], {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or not line.startswith(prefix):
            continue
        lines.append(line)
        if "{" in line:
            name = line[: line.index("{")]
            rest = line[line.rindex("}") + 1:].split()
        else:
            name, *rest = line.split()
        if not rest or name.endswith("_created"):
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        sums[name] = sums.get(name, 0.0) + value
    return lines, sums


def spec_decode_summary(metrics_text: str) -> dict:
    """The ``vllm:spec_decode*`` lines, the draft/accept counters and the mean
    acceptance length 1 + accepted / drafts (tokens gained per verification step)."""
    lines, sums = parse_prometheus(metrics_text, "vllm:spec_decode")

    def counter(base: str) -> float | None:
        for name in (base + "_total", base):
            if name in sums:
                return sums[name]
        return None

    drafts = counter("vllm:spec_decode_num_drafts")
    accepted = counter("vllm:spec_decode_num_accepted_tokens")
    draft_tokens = counter("vllm:spec_decode_num_draft_tokens")
    summary = {
        "lines": lines,
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": None,
        "counters_positive": bool(drafts and accepted and drafts > 0 and accepted > 0),
    }
    if drafts:
        summary["mean_acceptance_length"] = round(1.0 + (accepted or 0.0) / drafts, 4)
    return summary


def error_message(body: str) -> str:
    """The human-readable message of an error response (OpenAI, vLLM or FastAPI shape)."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, TypeError):
        return (body or "").strip()[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:1000]
        if isinstance(err, str) and err:
            return err[:1000]
        for key in ("message", "detail"):
            if data.get(key):
                value = data[key]
                return (value if isinstance(value, str) else json.dumps(value))[:1000]
    return json.dumps(data)[:500]


def compare_greedy(server: list[list[int]], offline: list[list[int]]) -> dict:
    """Token-for-token comparison; the first differing request and position."""
    identical = 0
    first = None
    for i, (a, b) in enumerate(zip(server, offline)):
        if a == b:
            identical += 1
            continue
        if first is None:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first = {"request": i, "position": pos,
                     "server": a[max(0, pos - 2): pos + 6], "offline": b[max(0, pos - 2): pos + 6],
                     "server_len": len(a), "offline_len": len(b)}
    total = max(len(server), len(offline))
    return {"identical": identical, "total": total, "all_identical": identical == total and total > 0,
            "first_difference": first}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: str, n_chars: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n_chars))
            return f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"


# --------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model directory (HF, with chat template)")
    p.add_argument("--drafter", help="DFlash drafter directory")
    p.add_argument("--out", help="result JSON path")
    p.add_argument("--log-dir", default=None, help="server logs go here (default: next to --out)")
    p.add_argument("--time-budget", type=float, default=420.0, help="overall seconds (default 420)")
    p.add_argument("--budget", type=int, default=32, help="DDTree tree budget (num_speculative_tokens)")
    p.add_argument("--max-depth", type=int, default=None, help="ddtree_max_depth (default: drafter's)")
    p.add_argument("--port", type=int, default=0, help="server port (0: a free one)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="auto", help="server and offline reference dtype "
                   "(float32 makes the greedy comparison exact)")
    p.add_argument("--reference-attention-backend", default="TRITON_ATTN",
                   help="attention backend of the offline no-speculation reference "
                        "(DDTree verifies on TRITON_ATTN; '' for vLLM's default)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--bad-config-timeout", type=float, default=120.0)
    p.add_argument("--request-timeout", type=float, default=60.0, help="per request, seconds")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", default=None, help="JSONL prompts (default: built-in set)")
    p.add_argument("--strict-greedy", action="store_true", help="fail on any greedy mismatch")
    p.add_argument("--skip-bad-configs", action="store_true")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--server-defaults", action="store_true",
                   help="first start `vllm serve TARGET --speculative-config ...` with no other "
                        "flag (vLLM's defaults, port 8000, CUDA graphs) and serve a small load")
    p.add_argument("--server-entrypoint", metavar="ENV_FILE",
                   help="first start the server as the image and the Kubernetes base do: "
                        "deploy/entrypoint.sh with ENV_FILE's variables (e.g. "
                        "deploy/k8s/base/ddtree.env), MODEL and DDTREE_DRAFTER pointed at "
                        "--target and --drafter, and serve a small load")
    p.add_argument("--feature-load", type=int, default=128,
                   help="requests of the mixed feature load (the feature settings in turn, "
                        "at --concurrency); 0 skips it")
    p.add_argument("--defaults-budget", type=int, default=64,
                   help="--server-defaults: num_speculative_tokens (default: the benchmarks' 64)")
    p.add_argument("--defaults-tokens-per-step", type=int, default=512,
                   help="--server-defaults: ddtree_tokens_per_step (default: the benchmarks' "
                        "512; 0 leaves it unset)")
    p.add_argument("--plain-server", action="store_true",
                   help="also start vLLM's server without speculation (same flags) and "
                        "compare its answers with the DDTree server's")
    p.add_argument("--offline-timeout", type=float, default=240.0)
    p.add_argument("--offline-references", nargs="+", choices=OFFLINE_REFERENCES,
                   default=list(OFFLINE_REFERENCES),
                   help="offline greedy references to compare the server with (default: both)")
    p.add_argument("--offline-cmd", default=None,
                   help="command prefix replacing `python serve_e2e.py --offline-worker` "
                        "(shell words; tests point it at a fake worker)")
    p.add_argument("--server-cmd", default=None,
                   help="command prefix replacing `python -m vllm.entrypoints.cli.main` "
                        "(shell words; tests point it at a fake server)")
    p.add_argument("--offline-worker", nargs=2, metavar=("SPEC_JSON", "OUT_JSON"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.offline_worker:
        return args
    missing = [f"--{n}" for n in ("target", "drafter", "out") if not getattr(args, n)]
    if missing:
        p.error("required: " + ", ".join(missing))
    for name in ("time_budget", "startup_timeout", "request_timeout", "bad_config_timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("concurrency", "num_requests", "max_tokens", "budget"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.log_dir is None:
        args.log_dir = os.path.dirname(os.path.abspath(args.out))
    return args


# The server's scheduler limits; the offline references run with the same ones.
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 8192

# Offline greedy references (phase 6): where each one's result goes in the JSON.
OFFLINE_REFERENCES = ("no-spec", "same-config")
OFFLINE_RESULT_KEYS = {"no-spec": "greedy", "same-config": "greedy_same_config"}


def speculative_config(drafter: str, budget: int, **extra) -> dict:
    config = {"method": "ddtree", "model": drafter, "num_speculative_tokens": budget}
    config.update({k: v for k, v in extra.items() if v is not None})
    return config


def bad_speculative_configs(drafter: str) -> list[dict]:
    """Two configs vllm_ddtree.config refuses at startup, with a regex-free needle
    that the refusal message contains (it names the setting and the value)."""
    return [
        {"name": "max_depth_beyond_block",
         "config": speculative_config(drafter, 32, ddtree_max_depth=16),
         "needle": "ddtree_max_depth=16"},
        {"name": "budget_above_512",
         "config": speculative_config(drafter, 513),
         "needle": "num_speculative_tokens (tree budget)=513"},
    ]


def server_prefix(server_cmd: str | None) -> list[str]:
    if server_cmd:
        return shlex.split(server_cmd)
    return [w.format(python=sys.executable) for w in DEFAULT_SERVER_PREFIX]


def serve_command(prefix: list[str], target: str, spec: dict | None, port: int, *,
                  gpu_memory_utilization: float = 0.25, max_model_len: int = 2048,
                  dtype: str = "auto") -> list[str]:
    """``vllm serve``; without ``spec``, plain decoding with the same flags."""
    return prefix + [
        "serve", target, "--dtype", dtype,
        *(["--speculative-config", json.dumps(spec)] if spec is not None else []),
        "--host", "127.0.0.1", "--port", str(port),
        "--gpu-memory-utilization", str(gpu_memory_utilization),
        "--max-model-len", str(max_model_len), "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
        "--enforce-eager", "--seed", "0",
        "--served-model-name", SERVED_MODEL_NAME,
    ]


# --------------------------------------------------------------------------- processes
class Deadline:
    def __init__(self, seconds: float) -> None:
        self.start = time.monotonic()
        self.end = self.start + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def bound(self, seconds: float) -> float:
        """``seconds``, cut to what is left of the budget (at least 1 s)."""
        return max(1.0, min(seconds, self.left()))


class ProcessRegistry:
    """Every child process group this script starts, so that the ``finally`` blocks
    and the watchdog can end them (only them) by process group id."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    def start(self, argv: list[str], *, env: dict, stdout, stderr) -> subprocess.Popen:
        proc = subprocess.Popen(argv, env=env, stdout=stdout, stderr=stderr,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        with self._lock:
            self._procs.append(proc)
        return proc

    @staticmethod
    def _group_alive(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def stop(self, proc: subprocess.Popen, term_wait: float = 30.0) -> dict:
        """SIGTERM the process group, wait, then SIGKILL whatever is left."""
        pgid = proc.pid
        info = {"pid": proc.pid, "sigkill": False}
        t = time.monotonic()
        if proc.poll() is None or self._group_alive(pgid):
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            end = time.monotonic() + term_wait
            while time.monotonic() < end:
                proc.poll()
                if proc.returncode is not None and not self._group_alive(pgid):
                    break
                time.sleep(0.2)
            if proc.poll() is None or self._group_alive(pgid):
                info["sigkill"] = True
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        info["returncode"] = proc.poll()
        info["stop_s"] = round(time.monotonic() - t, 2)
        with self._lock:
            if proc in self._procs:
                self._procs.remove(proc)
        return info

    def kill_all(self) -> None:
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def child_env() -> dict:
    env = dict(os.environ)
    env.update(SERVER_ENV)
    return env


# --------------------------------------------------------------------------- HTTP (sync)
@dataclass
class Reply:
    status: int
    body: str
    seconds: float
    error: str | None = None

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except (json.JSONDecodeError, TypeError):
            return None


def http(method: str, url: str, body: Any = None, *, raw: bytes | None = None,
         timeout: float = 30.0) -> Reply:
    """One request; never raises for HTTP or connection errors (status 0 = no reply)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    t = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Reply(resp.status, resp.read().decode("utf-8", "replace"), time.monotonic() - t)
    except urllib.error.HTTPError as exc:
        try:
            text = exc.read().decode("utf-8", "replace")
        except Exception:  # noqa: BLE001 - a broken body is still an HTTP error
            text = ""
        return Reply(exc.code, text, time.monotonic() - t)
    except Exception as exc:  # noqa: BLE001 - connection refused, timeout, reset...
        return Reply(0, "", time.monotonic() - t, error=repr(exc))


def http_stream(url: str, body: dict, *, timeout: float = 60.0) -> dict:
    """POST a ``stream: true`` request; returns status, events and whether [DONE] came."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    parser, events = SSEParser(), []
    t = time.monotonic()
    end = t + timeout
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status = resp.status
            while time.monotonic() < end:
                line = resp.readline()
                if not line:
                    break
                events += parser.feed(line)
                if parser.done:
                    break
            events += parser.close()
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "events": [], "done": False,
                "error": error_message(exc.read().decode("utf-8", "replace")),
                "seconds": time.monotonic() - t}
    except Exception as exc:  # noqa: BLE001
        return {"status": 0, "events": events, "done": parser.done, "error": repr(exc),
                "seconds": time.monotonic() - t}
    return {"status": status, "events": events, "done": parser.done, "error": None,
            "seconds": time.monotonic() - t}


def stream_completion_text(events: list) -> tuple[str, list[int], list[int] | None, dict | None]:
    """Text, generated token ids, prompt token ids and usage of a streamed completion."""
    text, ids, prompt_ids, usage = [], [], None, None
    for ev in events:
        if not isinstance(ev, dict):
            continue
        usage = ev.get("usage") or usage
        for choice in ev.get("choices") or []:
            text.append(choice.get("text") or "")
            ids += choice.get("token_ids") or []
            if choice.get("prompt_token_ids"):
                prompt_ids = choice["prompt_token_ids"]
    return "".join(text), ids, prompt_ids, usage


def stream_chat_text(events: list) -> str:
    parts = []
    for ev in events:
        if isinstance(ev, dict):
            for choice in ev.get("choices") or []:
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


# --------------------------------------------------------------------------- the run
@dataclass
class Run:
    args: argparse.Namespace
    deadline: Deadline
    procs: ProcessRegistry = field(default_factory=ProcessRegistry)
    result: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    # Greedy token ids of the offline references, by reference (for the margins).
    offline_ids: dict = field(default_factory=dict)
    # The mixed feature load's requests and their answers (phase feature_load).
    feature_load: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self, phase: str, name: str, ok: bool, **detail) -> bool:
        entry = {"name": name, "ok": bool(ok), **detail}
        with self.lock:
            self.result.setdefault("checks", {}).setdefault(phase, []).append(entry)
            if not ok:
                self.failures.append(f"{phase}/{name}")
        print(f"[{'ok' if ok else 'FAIL'}] {phase}/{name}"
              + (f": {detail.get('message') or detail.get('error') or ''}" if not ok else ""),
              flush=True)
        return bool(ok)

    def exact_check(self, phase: str, name: str, ok: bool, **detail) -> bool:
        """A check of identical tokens: a failure in float32; in another dtype the
        server's tree budget changes the verification's shapes (the online controller
        moves it between requests) and so its rounding, and a near tie of the
        target's argmax may flip, so there it is recorded as an observation."""
        if self.args.dtype == "float32":
            return self.check(phase, name, ok, **detail)
        entry = {"name": name, "identical": bool(ok), "dtype": self.args.dtype, **detail}
        with self.lock:
            self.result.setdefault("observations", {}).setdefault(phase, []).append(entry)
        print(f"[note] {phase}/{name}: {'identical' if ok else 'differs'} "
              f"(exact only in float32)" + (f": {detail.get('message')}" if not ok else ""),
              flush=True)
        return bool(ok)

    def write(self) -> None:
        with self.lock:
            self.result["failures"] = list(self.failures)
            self.result["passed"] = not self.failures
            self.result["elapsed_s"] = round(time.monotonic() - self.deadline.start, 1)
            text = json.dumps(self.result, indent=2, default=str)
        os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
        tmp = self.args.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self.args.out)


def probe_vllm(run: Run) -> None:
    """vLLM version and DDTree series, read in a child so this process stays CUDA-free."""
    code = ("import json, vllm; print(json.dumps({'vllm_version': vllm.__version__, "
            "'ddtree_series': getattr(vllm, 'ddtree_series', None)}))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=run.deadline.bound(90), env=child_env())
        # vLLM may log to stdout as well: take the last line that is a JSON object.
        line = next(ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("{"))
        info = json.loads(line)
    except Exception as exc:  # noqa: BLE001 - informative; the server run decides
        info = {"vllm_version": None, "ddtree_series": None, "probe_error": repr(exc)}
    run.result.update(info)
    present = bool(info.get("ddtree_series"))
    run.check("setup", "ddtree_series_present", present,
              message=None if present else "vllm.ddtree_series is not set: the series is not applied")


def run_bad_configs(run: Run, prefix: list[str]) -> None:
    """Start the server with each invalid config (in parallel); each must exit non-zero
    within the timeout and name the setting in its output."""
    args = run.args
    started = []
    for bad in bad_speculative_configs(args.drafter):
        log_path = os.path.join(args.log_dir, f"bad-config-{bad['name']}.log")
        cmd = serve_command(prefix, args.target, bad["config"], free_port(),
                            gpu_memory_utilization=args.gpu_memory_utilization,
                            max_model_len=args.max_model_len)
        log = open(log_path, "wb")
        proc = run.procs.start(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        started.append((bad, cmd, proc, log, log_path, time.monotonic()))
    end = time.monotonic() + run.deadline.bound(args.bad_config_timeout)
    records = []
    for bad, cmd, proc, log, log_path, t0 in started:
        timed_out = False
        try:
            proc.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        stop = run.procs.stop(proc, term_wait=5)
        log.close()
        output = tail(log_path, 200_000)
        message = next((ln.strip() for ln in output.splitlines() if bad["needle"] in ln), None)
        rc = proc.returncode
        record = {"name": bad["name"], "config": bad["config"], "command": shlex.join(cmd),
                  "returncode": rc, "timed_out": timed_out,
                  "seconds": round(time.monotonic() - t0, 1), "message": message,
                  "log": log_path, "stop": stop}
        if message is None:
            record["log_tail"] = output[-3000:]
        records.append(record)
        run.check("bad_configs", bad["name"], not timed_out and rc not in (0, None) and message is not None,
                  returncode=rc, timed_out=timed_out, message=message or f"'{bad['needle']}' not in output")
    run.result["bad_configs"] = records


def wait_healthy(run: Run, proc: subprocess.Popen, base: str, timeout: float,
                 stderr_path: str, phase: str = "startup", into: dict | None = None) -> bool:
    """Wait for /health; the outcome goes to ``into`` (default: the result's
    ``startup``) and a ``<phase>/server_healthy`` check."""
    t0 = time.monotonic()
    end = t0 + run.deadline.bound(timeout)
    into = run.result.setdefault("startup", {}) if into is None else into
    while time.monotonic() < end:
        if proc.poll() is not None:
            into.update(ok=False, returncode=proc.returncode,
                        seconds=round(time.monotonic() - t0, 1), log_tail=tail(stderr_path))
            run.check(phase, "server_healthy", False,
                      message=f"server exited with {proc.returncode} before /health was 200")
            return False
        if http("GET", base + "/health", timeout=5).status == 200:
            into.update(ok=True, seconds=round(time.monotonic() - t0, 1))
            return run.check(phase, "server_healthy", True)
        time.sleep(1.0)
    into.update(ok=False, timed_out=True, seconds=round(time.monotonic() - t0, 1),
                log_tail=tail(stderr_path))
    run.check(phase, "server_healthy", False, message=f"/health not 200 within {timeout:.0f} s")
    return False


def first_choice(r) -> dict:
    """The first choice of an OpenAI completion or chat answer ({} when there is none)."""
    return (((r.json() or {}).get("choices")) or [{}])[0]


def check_endpoints(run: Run, base: str) -> None:
    to = run.args.request_timeout
    r = http("GET", base + "/health", timeout=10)
    run.check("endpoints", "health", r.status == 200, status=r.status, error=r.error)

    r = http("GET", base + "/v1/models", timeout=10)
    ids = [m.get("id") for m in ((r.json() or {}).get("data") or []) if isinstance(m, dict)]
    run.check("endpoints", "models", r.status == 200 and SERVED_MODEL_NAME in ids,
              status=r.status, models=ids, message=f"models={ids}")

    prompt = "The capital of France is"
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 32,
            "temperature": 0, "return_token_ids": True}
    r = http("POST", base + "/v1/completions", body, timeout=to)
    choice = first_choice(r)
    text, ids = choice.get("text"), choice.get("token_ids")
    run.check("endpoints", "completion", r.status == 200 and bool(text), status=r.status,
              text=text, token_ids=ids, message=error_message(r.body) if r.status != 200 else None)

    s = http_stream(base + "/v1/completions", dict(body, stream=True,
                    stream_options={"include_usage": True}), timeout=to)
    s_text, s_ids, _, usage = stream_completion_text(s["events"])
    run.check("endpoints", "completion_stream", s["status"] == 200 and s["done"] and bool(s_text),
              status=s["status"], done=s["done"], text=s_text, usage=usage, error=s["error"])
    same = s_text == text and (ids is None or not s_ids or s_ids == ids)
    run.exact_check("endpoints", "completion_stream_equals_nonstream", same,
              message=None if same else f"stream {s_text!r} vs non-stream {text!r}")

    chat = {"model": SERVED_MODEL_NAME, "max_tokens": 32, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three primary colors."}]}
    r = http("POST", base + "/v1/chat/completions", chat, timeout=to)
    choice = first_choice(r)
    c_text = (choice.get("message") or {}).get("content")
    run.check("endpoints", "chat", r.status == 200 and bool(c_text), status=r.status, text=c_text,
              message=error_message(r.body) if r.status != 200 else None)
    s = http_stream(base + "/v1/chat/completions", dict(chat, stream=True), timeout=to)
    sc_text = stream_chat_text(s["events"])
    run.check("endpoints", "chat_stream", s["status"] == 200 and s["done"] and bool(sc_text),
              status=s["status"], done=s["done"], text=sc_text, error=s["error"])
    run.exact_check("endpoints", "chat_stream_equals_nonstream", sc_text == c_text,
              message=None if sc_text == c_text else f"stream {sc_text!r} vs non-stream {c_text!r}")

    check_metrics(run, base, "after_endpoints", hard=False)


def check_metrics(run: Run, base: str, label: str, hard: bool) -> dict:
    """Spec-decode counters; stats reach Prometheus asynchronously, so retry briefly."""
    summary: dict = {}
    for _ in range(5):
        r = http("GET", base + "/metrics", timeout=10)
        summary = spec_decode_summary(r.body if r.status == 200 else "")
        summary["status"] = r.status
        if summary["counters_positive"]:
            break
        time.sleep(1.0)
    run.result.setdefault("spec_decode_metrics", {})[label] = summary
    if hard:
        run.check("endpoints", "spec_decode_counters_positive", summary["counters_positive"],
                  num_drafts=summary["num_drafts"], num_accepted_tokens=summary["num_accepted_tokens"],
                  mean_acceptance_length=summary["mean_acceptance_length"],
                  message=f"drafts={summary['num_drafts']} accepted={summary['num_accepted_tokens']}")
    return summary


def bad_requests(model: str) -> list[dict]:
    """Requests that must get a 4xx: what speculative decoding refuses, then plain client
    errors."""
    base = {"model": model, "prompt": "Hello, my name is", "max_tokens": 8, "temperature": 0}
    return [
        # What vLLM refuses with any speculative decoding (SamplingParams._validate_spec_decode).
        {"name": "logit_bias", "path": "/v1/completions",
         "body": dict(base, logit_bias={"1": 5.0}), "expect": 400, "mentions": "logit_bias"},
        {"name": "negative_max_tokens", "path": "/v1/completions", "body": dict(base, max_tokens=-1),
         "expect": 400, "mentions": "max_tokens"},
        {"name": "unknown_model", "path": "/v1/completions", "body": dict(base, model="no-such-model"),
         "expect": 404, "mentions": None},
        {"name": "malformed_json", "path": "/v1/completions",
         "raw": b'{"model": "' + model.encode() + b'", "prompt": "Hi", ', "expect": 400,
         "mentions": None},
    ]


def check_bad_requests(run: Run, base: str) -> None:
    records = []
    for bad in bad_requests(SERVED_MODEL_NAME):
        r = http("POST", base + bad["path"], bad.get("body"), raw=bad.get("raw"),
                 timeout=run.args.request_timeout)
        message = error_message(r.body)
        record = {"name": bad["name"], "status": r.status, "expected_status": bad["expect"],
                  "message": message, "error": r.error,
                  "names_setting": (bad["mentions"] in message) if bad["mentions"] else None}
        records.append(record)
        # Hard: a 4xx with a message. The exact code and wording are recorded only.
        run.check("bad_requests", bad["name"], 400 <= r.status < 500 and bool(message),
                  status=r.status, message=message)
    run.result["bad_requests"] = records
    r = http("GET", base + "/health", timeout=10)
    run.check("bad_requests", "healthy_after", r.status == 200, status=r.status, error=r.error)
    r = http("POST", base + "/v1/completions",
             {"model": SERVED_MODEL_NAME, "prompt": "One, two, three,", "max_tokens": 8,
              "temperature": 0}, timeout=run.args.request_timeout)
    run.check("bad_requests", "serves_after", r.status == 200, status=r.status,
              message=error_message(r.body) if r.status != 200 else None)


# Request settings DDTree serves (logprobs on trees; penalties, bad words and grammars
# decoded without drafts), each sent at T=0 and at T=1 with a seed, streamed and not, all
# at once so that they share batches with ordinary requests; then compared token for
# token (and logprob for logprob) with decoding without speculation offline.
# A bounded string, so that the object fits in the grammar request's token budget.
FEATURE_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}},
                  "required": ["name"]}
FEATURE_SETTINGS = (
    ("ordinary", {}),
    ("logprobs", {"logprobs": 2}),
    ("presence_penalty", {"presence_penalty": 0.5}),
    ("repetition_frequency_penalties", {"repetition_penalty": 1.2, "frequency_penalty": 0.3}),
    ("bad_words", {"bad_words": [" the"]}),
    ("structured_output_json", {"structured_outputs": {"json": FEATURE_SCHEMA}}),
    # Computed at prefill; vLLM answers them in a non-streamed choice only (a streamed
    # request with them is refused with 400, with or without speculation).
    ("prompt_logprobs", {"prompt_logprobs": 1}),
)
FEATURE_MAX_TOKENS = 24
GRAMMAR_MAX_TOKENS = 64  # the model may emit whitespace the JSON grammar allows
# The request fields the offline reference passes to SamplingParams as they are.
FEATURE_SAMPLING_FIELDS = ("temperature", "seed", "max_tokens", "ignore_eos", "logprobs",
                           "prompt_logprobs", "presence_penalty", "repetition_penalty",
                           "frequency_penalty", "bad_words", "structured_outputs")


def feature_requests(model: str) -> list[dict]:
    """One completion per (setting, temperature, streamed or not): ``logprobs`` asks
    that many top logprobs per token, ``json_field``: the answer must parse as a JSON
    object with that field. Prompts cycle through the built-in ones."""
    prompts = builtin_prompts()
    out = []
    for name, extra in FEATURE_SETTINGS:
        for temp in (0.0, 1.0):
            for stream in (False, True):
                if stream and "prompt_logprobs" in extra:
                    continue
                i = len(out)
                body = {"model": model, "prompt": prompts[i % len(prompts)],
                        "max_tokens": (GRAMMAR_MAX_TOKENS if "structured_outputs" in extra
                                       else FEATURE_MAX_TOKENS), "temperature": temp,
                        "return_token_ids": True, **extra}
                if temp:
                    body["seed"] = 1000 + i
                if "structured_outputs" not in extra:
                    body["ignore_eos"] = True  # the grammar ends the others
                if stream:
                    body.update(stream=True, stream_options={"include_usage": True})
                out.append({"name": name, "temperature": temp, "stream": stream, "body": body,
                            "logprobs": extra.get("logprobs"),
                            "prompt_logprobs": bool(extra.get("prompt_logprobs")),
                            "json_field": "name" if "structured_outputs" in extra else None})
    return out


def _answer(choice: dict) -> str | None:
    if "message" in choice:
        return (choice.get("message") or {}).get("content")
    return choice.get("text")


def _feature_record(req: dict, status: int, body: str, events: list | None) -> dict:
    """What one feature request answered: text, token ids, the emitted tokens' logprobs
    and top-logprob counts (streamed answers reassembled from their chunks)."""
    rec = {"name": req["name"], "temperature": req["temperature"], "stream": req["stream"],
           "status": status, "text": None, "token_ids": None, "prompt_token_ids": None,
           "token_logprobs": None, "top_counts": None, "prompt_token_logprobs": None,
           "finish_reason": None, "message": error_message(body) if status != 200 else None}
    if status != 200:
        return rec
    if events is None:
        try:
            choices = (json.loads(body) or {}).get("choices") or [{}]
        except ValueError:
            choices = [{}]
    else:
        choices = [c for e in events if isinstance(e, dict) for c in (e.get("choices") or [])]
    text, ids, prompt_ids, lps, tops, prompt_lps, finish = [], [], None, [], [], None, None
    for c in choices:
        prompt_lps = prompt_lps or c.get("prompt_logprobs")
        finish = c.get("finish_reason") or finish
        text.append(c.get("text") or "")
        ids += c.get("token_ids") or []
        prompt_ids = prompt_ids or c.get("prompt_token_ids")
        lp = c.get("logprobs") or {}
        lps += lp.get("token_logprobs") or []
        tops += [len(t or {}) for t in lp.get("top_logprobs") or []]
    rec.update(text="".join(text), token_ids=ids, prompt_token_ids=prompt_ids, finish_reason=finish,
               token_logprobs=lps if req["logprobs"] else None,
               top_counts=tops if req["logprobs"] else None)
    if req.get("prompt_logprobs") and prompt_lps and prompt_ids:
        # Each prompt token's own logprob (the first has none); JSON keys are strings.
        rec["prompt_token_logprobs"] = [
            None if e is None else (e.get(str(t)) or {}).get("logprob")
            for e, t in zip(prompt_lps, prompt_ids)]
    return rec


async def _send_features(base: str, reqs: list[dict], timeout_s: float,
                         concurrency: int | None = None) -> list[dict]:
    """Send ``reqs`` (all at once, or at most ``concurrency`` in flight)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    sem = asyncio.Semaphore(concurrency or max(len(reqs), 1))

    async def one(session, req: dict) -> dict:
        async with sem:
            return await _one_feature(session, req)

    async def _one_feature(session, req: dict) -> dict:
        try:
            async with session.post(base + "/v1/completions", json=req["body"],
                                    timeout=timeout) as resp:
                if not req["stream"] or resp.status != 200:
                    return _feature_record(req, resp.status, await resp.text(), None)
                parser, events = SSEParser(), []
                async for chunk in resp.content.iter_any():
                    events += parser.feed(chunk)
                    if parser.done:
                        break
                events += parser.close()
                return _feature_record(req, resp.status, "", events)
        except Exception as exc:  # noqa: BLE001 - a failed request is a failed check
            return dict(_feature_record(req, 599, "", None), message=repr(exc))

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session, r) for r in reqs)))


# What may follow a JSON object cut off by the token limit, to close it again.
_JSON_CLOSERS = ("", "}", '"}', '""}', ':""}', '":""}')


def json_answer_ok(text: str | None, field: str, finish_reason: str | None) -> bool:
    """A grammar-constrained answer: a JSON object with ``field`` when it stopped on
    its own; when it hit the token limit, a prefix of one (some closer completes it)."""
    closers = _JSON_CLOSERS if finish_reason == "length" else ("",)
    for closer in closers:
        try:
            parsed = json.loads((text or "").rstrip() + closer)
        except ValueError:
            continue
        if isinstance(parsed, dict) and (field in parsed or closer):
            return True
    return False


def feature_tag(req: dict) -> str:
    return req.get("tag") or (
        f"{req['name']}_T{req['temperature']:g}_{'stream' if req['stream'] else 'nonstream'}")


def feature_load_requests(model: str, n: int) -> list[dict]:
    """``n`` feature requests for the mixed load: the feature phase's settings in turn
    (ordinary ones among them), each on another built-in prompt, seeded T=1 ones with
    their own seed."""
    base, prompts = feature_requests(model), builtin_prompts()
    out = []
    for i in range(n):
        q = json.loads(json.dumps(base[i % len(base)]))
        q["body"]["prompt"] = prompts[(7 * i + 3) % len(prompts)]
        if q["temperature"]:
            q["body"]["seed"] = 5000 + i
        q["tag"] = f"load{i}_{feature_tag(q)}"
        out.append(q)
    return out


def feature_answer_ok(req: dict, rec: dict) -> bool:
    """A feature request answered as asked: 200 with tokens, the asked number of top
    logprobs for every token, a prompt logprob for every prompt token but the first,
    a JSON answer where the grammar asked for one."""
    ok = rec["status"] == 200 and bool(rec["token_ids"])
    if ok and req["logprobs"]:
        counts = rec["top_counts"] or []
        ok = (len(counts) == len(rec["token_ids"]) == len(rec["token_logprobs"] or [])
              and all(n >= req["logprobs"] for n in counts))
    if ok and req.get("prompt_logprobs"):
        vals = rec["prompt_token_logprobs"] or []
        ok = (len(vals) == len(rec["prompt_token_ids"] or []) > 1
              and all(v is not None for v in vals[1:]))
    if ok and req["json_field"]:
        ok = json_answer_ok(rec["text"], req["json_field"], rec["finish_reason"])
    return ok


def check_features(run: Run, base: str) -> None:
    reqs = feature_requests(SERVED_MODEL_NAME)
    records = asyncio.run(_send_features(base, reqs, run.args.request_timeout))
    for req, rec in zip(reqs, records):
        tag = feature_tag(req)
        rec["check"] = tag
        run.check("features", tag, feature_answer_ok(req, rec), status=rec["status"],
                  answer=rec["text"], message=rec["message"])
    # The chat route of structured outputs: response_format json_schema.
    chat = {"model": SERVED_MODEL_NAME, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": "Give me a name as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": FEATURE_SCHEMA}}}
    r = http("POST", base + "/v1/chat/completions", chat, timeout=run.args.request_timeout)
    answer = _answer(first_choice(r)) if r.status == 200 else None
    try:
        parsed = json.loads(answer) if answer else None
    except ValueError:
        parsed = None
    run.check("features", "chat_response_format_json_schema",
              r.status == 200 and isinstance(parsed, dict) and "name" in parsed,
              status=r.status, answer=answer,
              message=error_message(r.body) if r.status != 200 else None)
    run.result["features"] = records


def feature_reference_requests(records: list[dict], reqs: list[dict] | None = None) -> list[dict]:
    """The answered feature requests as the offline reference replays them: the server's
    prompt token ids and the request's sampling fields (``reqs``: the requests sent,
    default the feature phase's)."""
    by_tag = {feature_tag(q): q for q in (reqs or feature_requests(SERVED_MODEL_NAME))}
    out = []
    for rec in records:
        if rec.get("status") != 200 or not rec.get("prompt_token_ids"):
            continue
        body = by_tag[rec["check"]]["body"]
        out.append({"check": rec["check"], "prompt_token_ids": rec["prompt_token_ids"],
                    "params": {k: body[k] for k in FEATURE_SAMPLING_FIELDS if k in body}})
    return out


def compare_features(records: list[dict], reference: list[dict]) -> dict:
    """Server against offline, per feature request: identical token ids, for the
    logprobs requests the largest |logprob difference| over the identical prefix, and
    for prompt logprobs the largest over the prompt's tokens."""
    answered = {r["check"]: r for r in records if r.get("status") == 200}
    rows, worst, worst_prompt = [], 0.0, 0.0
    for ref in reference:
        got = answered.get(ref["check"])
        if got is None:
            continue
        same = got["token_ids"] == ref["token_ids"]
        row = {"check": ref["check"], "identical": same}
        if not same:
            n = next((i for i, (a, b) in enumerate(zip(got["token_ids"], ref["token_ids"]))
                      if a != b), min(len(got["token_ids"]), len(ref["token_ids"])))
            row["first_difference"] = n
        if got.get("prompt_token_logprobs") and ref.get("prompt_logprobs"):
            pairs = [(a, b) for a, b in zip(got["prompt_token_logprobs"], ref["prompt_logprobs"])
                     if a is not None and b is not None]
            row["max_prompt_logprob_abs_diff"] = round(max((abs(a - b) for a, b in pairs),
                                                           default=0.0), 6)
            worst_prompt = max(worst_prompt, row["max_prompt_logprob_abs_diff"])
        if got.get("token_logprobs") is not None and ref.get("logprobs") is not None:
            diffs = [abs(a - b) for (ta, tb, a, b) in zip(got["token_ids"], ref["token_ids"],
                                                          got["token_logprobs"], ref["logprobs"])
                     if ta == tb and a is not None and b is not None]
            # Over the identical prefix only.
            k = row.get("first_difference", len(diffs))
            row["max_logprob_abs_diff"] = round(max(diffs[:k], default=0.0), 6)
            worst = max(worst, row["max_logprob_abs_diff"])
        rows.append(row)
    return {"identical": sum(r["identical"] for r in rows), "total": len(rows),
            "max_logprob_abs_diff": round(worst, 6),
            "max_prompt_logprob_abs_diff": round(worst_prompt, 6), "requests": rows}


async def _load(base: str, prompts: list[str], concurrency: int, max_tokens: int,
                request_timeout: float, model: str = SERVED_MODEL_NAME
                ) -> tuple[list[dict], float]:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    url = base + "/v1/completions"

    async def one(session, i: int, prompt: str) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        rec = {"index": i, "prompt": prompt, "error": None}
        async with sem:
            t0 = time.monotonic()
            try:
                async with session.post(url, json=body, timeout=timeout) as resp:
                    if resp.status != 200:
                        rec["error"] = f"HTTP {resp.status}: {error_message(await resp.text())}"
                        return rec
                    parser, events, ttft = SSEParser(), [], None
                    async for chunk in resp.content.iter_any():
                        new = parser.feed(chunk)
                        if ttft is None and any(isinstance(e, dict) and e.get("choices") for e in new):
                            ttft = time.monotonic() - t0
                        events += new
                        if parser.done:
                            break
                    events += parser.close()
            except Exception as exc:  # noqa: BLE001 - counted as a load error
                rec["error"] = repr(exc)
                return rec
            rec["latency_s"] = time.monotonic() - t0
        rec["ttft_s"] = ttft
        text, ids, prompt_ids, usage = stream_completion_text(events)
        rec.update(text=text, token_ids=ids, prompt_token_ids=prompt_ids)
        n = (usage or {}).get("completion_tokens", len(ids))
        rec["output_tokens"] = n
        bad = [e["_unparsed"] for e in events if isinstance(e, dict) and "_unparsed" in e]
        if not parser.done:
            rec["error"] = "stream ended without [DONE]"
        elif bad:
            rec["error"] = f"unparsable event: {bad[0][:200]}"
        elif n != max_tokens:
            rec["error"] = f"{n} output tokens, expected {max_tokens} (ignore_eos)"
        return rec

    connector = aiohttp.TCPConnector(limit=concurrency)
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=connector) as session:
        results = await asyncio.gather(*(one(session, i, p) for i, p in enumerate(prompts)))
    return list(results), time.monotonic() - t0


def load_deadline(run: Run, num_requests: int) -> float:
    """Seconds a load of ``num_requests`` at ``--concurrency`` may take (within the
    overall budget)."""
    args = run.args
    return run.deadline.bound(max(args.request_timeout * 2, 60) +
                              args.request_timeout * num_requests / args.concurrency)


def load_throughput(results: list[dict], wall: float) -> dict:
    """Requests, errors and output tokens/s of one load."""
    tokens = sum(r.get("output_tokens") or 0 for r in results if not r["error"])
    return {"num_requests": len(results), "errors": sum(1 for r in results if r["error"]),
            "wall_s": round(wall, 3), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / wall, 1) if wall > 0 else None}


def run_load(run: Run, base: str) -> list[dict]:
    args = run.args
    prompts, source = select_prompts(args.num_requests, args.prompts)
    limit = load_deadline(run, args.num_requests)
    try:
        results, wall = asyncio.run(asyncio.wait_for(
            _load(base, prompts, args.concurrency, args.max_tokens, args.request_timeout), limit))
    except Exception as exc:  # noqa: BLE001 - includes the phase timeout
        run.check("load", "completed", False, message=repr(exc))
        return []
    errors = [r for r in results if r["error"]]
    ok = [r for r in results if not r["error"]]
    summary = {
        "prompt_source": source, "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, **load_throughput(results, wall),
        "error_samples": [{"index": r["index"], "error": r["error"]} for r in errors[:10]],
        "latency": latency_summary([r["latency_s"] for r in ok]),
        "ttft": latency_summary([r["ttft_s"] for r in ok if r.get("ttft_s") is not None]),
    }
    run.result["load"] = summary
    run.check("load", "zero_errors", not errors and len(results) == args.num_requests,
              errors=len(errors), message=errors[0]["error"] if errors else None)
    print(f"load: {len(results)} requests, {len(errors)} errors, "
          f"{summary['output_tokens_per_s']} tok/s, p50 {summary['latency'].get('p50_s')} s, "
          f"p99 {summary['latency'].get('p99_s')} s", flush=True)
    return results


def run_feature_load(run: Run, base: str) -> None:
    """``--feature-load`` requests of the feature settings in turn, streamed and not,
    at ``--concurrency``: every one answered as asked (``feature_answer_ok``)."""
    args = run.args
    reqs = feature_load_requests(SERVED_MODEL_NAME, args.feature_load)
    t0 = time.monotonic()
    try:
        records = asyncio.run(asyncio.wait_for(
            _send_features(base, reqs, args.request_timeout, args.concurrency),
            load_deadline(run, len(reqs))))
    except Exception as exc:  # noqa: BLE001 - includes the phase timeout
        run.check("feature_load", "completed", False, message=repr(exc))
        return
    wall = time.monotonic() - t0
    bad = []
    for req, rec in zip(reqs, records):
        rec["check"] = feature_tag(req)
        if not feature_answer_ok(req, rec):
            bad.append(rec)
    run.feature_load = list(zip(reqs, records))
    tokens = sum(len(r["token_ids"] or []) for r in records if r["status"] == 200)
    run.result["feature_load"] = {
        "num_requests": len(reqs), "concurrency": args.concurrency, "errors": len(bad),
        "settings": sorted({r["name"] for r in reqs}), "wall_s": round(wall, 3),
        "output_tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
        "error_samples": [{"check": r["check"], "status": r["status"], "message": r["message"]}
                          for r in bad[:10]],
        "records": records}
    run.check("feature_load", "zero_errors", not bad, errors=len(bad),
              message=(f"{bad[0]['check']}: HTTP {bad[0]['status']} {bad[0]['message'] or ''}"
                       if bad else None))
    print(f"feature load: {len(reqs)} requests at concurrency {args.concurrency}, "
          f"{len(bad)} errors", flush=True)


# --------------------------------------------------------------------------- vLLM's defaults
VLLM_DEFAULT_PORT = 8000


def port_free(port: int) -> bool:
    """Nothing listens on ``port`` (a closed socket's TIME_WAIT does not count: the
    server binds with SO_REUSEADDR, as uvicorn does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def run_server_defaults(run: Run, prefix: list[str]) -> None:
    """``--server-defaults``: ``vllm serve TARGET --speculative-config JSON`` and no other
    flag (vLLM's port, memory share, context length, concurrency, tokens per step and CUDA
    graphs as it picks them), as a user starts it from the docs; the config is the
    benchmarks' (``--defaults-budget`` 64, ``--defaults-tokens-per-step`` 512), which once
    did not start on vLLM's defaults. It must become healthy,
    answer a completion and a chat completion, and serve ``--concurrency`` streamed
    requests without an error; DDTree's log lines about what it changed are kept."""
    args = run.args
    spec = speculative_config(args.drafter, args.defaults_budget,
                              ddtree_tokens_per_step=args.defaults_tokens_per_step or None)
    cmd = prefix + ["serve", args.target, "--speculative-config", json.dumps(spec)]
    info: dict = {"command": shlex.join(cmd)}
    run.result["server_defaults"] = info
    serve_as_a_user(run, "server_defaults", cmd, child_env(), VLLM_DEFAULT_PORT, info)


ENTRYPOINT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "deploy", "entrypoint.sh")


def read_env_file(path: str) -> dict[str, str]:
    """``KEY=VALUE`` lines as a Kubernetes ``configMapGenerator`` ``envs:`` file holds
    them (blank lines and ``#`` comments skipped, no quoting)."""
    env: dict[str, str] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key:
                raise ValueError(f"{path}:{n}: not KEY=VALUE: {line!r}")
            env[key] = value
    return env


def run_server_entrypoint(run: Run, prefix: list[str], tmp_dir: str) -> None:
    """``--server-entrypoint ENV_FILE``: the server as the image and the Kubernetes base
    start it: ``deploy/entrypoint.sh`` with the image's environment and the variables of
    ENV_FILE (``deploy/k8s/base/ddtree.env``: budget, tokens per step, context length,
    memory share, port), nothing else; only ``MODEL`` and ``DDTREE_DRAFTER`` point at
    ``--target`` and ``--drafter`` instead of the pod's volume. ``vllm`` on the PATH runs
    this host's vLLM (the image's console script). The same checks as
    ``--server-defaults``; the ``vllm serve`` line the entrypoint built is recorded
    (its ``--print``)."""
    args = run.args
    shipped = read_env_file(args.server_entrypoint)
    variables = dict(shipped, MODEL=args.target, DDTREE_DRAFTER=args.drafter)
    bin_dir = os.path.join(tmp_dir, "entrypoint-bin")
    os.makedirs(bin_dir, exist_ok=True)
    shim = os.path.join(bin_dir, "vllm")
    with open(shim, "w") as f:
        f.write("#!/usr/bin/env bash\n# `vllm`, as the image's console script runs it\n"
                f"exec {shlex.join(prefix)} \"$@\"\n")
    os.chmod(shim, 0o755)
    env = child_env()
    env.update(IMAGE_ENV)
    env.update(variables)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    cmd = ["bash", ENTRYPOINT]
    info: dict = {"command": shlex.join(cmd), "env_file": args.server_entrypoint,
                  "variables": variables}
    run.result["server_entrypoint"] = info
    printed = subprocess.run(cmd + ["--print"], env=env, capture_output=True, text=True,
                             timeout=60)
    info["vllm_command"] = printed.stdout.strip()
    if not run.check("server_entrypoint", "entrypoint_accepts_the_variables",
                     printed.returncode == 0, message=printed.stderr.strip()[-400:] or None):
        return
    port = int(variables.get("PORT") or IMAGE_ENV["PORT"])
    serve_as_a_user(run, "server_entrypoint", cmd, env, port, info)


def serve_as_a_user(run: Run, phase: str, cmd: list[str], env: dict, port: int,
                    info: dict) -> None:
    """Start ``cmd`` (a server on ``port``), then check what a user of it does first:
    healthy, a completion, a chat completion, ``--concurrency`` streamed requests without
    an error; DDTree's log lines (what it changed and why) go to ``info``."""
    args = run.args
    stdout_path = os.path.join(args.log_dir, f"{phase}.stdout.log")
    stderr_path = os.path.join(args.log_dir, f"{phase}.stderr.log")
    info.update(startup={}, logs={"stdout": stdout_path, "stderr": stderr_path})
    if not port_free(port):
        run.check(phase, "port_free", False, message=f"port {port} is in use")
        return
    base = f"http://127.0.0.1:{port}"
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        proc = run.procs.start(cmd, env=env, stdout=out, stderr=err)
    try:
        if not wait_healthy(run, proc, base, args.startup_timeout, stderr_path,
                            phase=phase, into=info["startup"]):
            return
        r = http("GET", base + "/v1/models", timeout=10)
        names = [m.get("id") for m in ((r.json() or {}).get("data") or []) if isinstance(m, dict)]
        model = names[0] if names else args.target
        info["model"] = model
        to = args.request_timeout
        r = http("POST", base + "/v1/completions",
                 {"model": model, "prompt": "The capital of France is", "max_tokens": 16,
                  "temperature": 0}, timeout=to)
        run.check(phase, "completion", r.status == 200 and bool(_answer(first_choice(r))),
                  status=r.status, message=error_message(r.body) if r.status != 200 else None)
        r = http("POST", base + "/v1/chat/completions",
                 {"model": model, "max_tokens": 16, "temperature": 0,
                  "messages": [{"role": "user", "content": "Name three primary colors."}]},
                 timeout=to)
        run.check(phase, "chat", r.status == 200 and bool(_answer(first_choice(r))),
                  status=r.status, message=error_message(r.body) if r.status != 200 else None)
        prompts, _ = select_prompts(args.concurrency, args.prompts)
        limit = run.deadline.bound(max(to * 2, 60))
        results, wall = asyncio.run(asyncio.wait_for(
            _load(base, prompts, args.concurrency, args.max_tokens, to, model=model), limit))
        errors = [x for x in results if x["error"]]
        info["load"] = load_throughput(results, wall)
        run.check(phase, "load_zero_errors", not errors,
                  message=errors[0]["error"] if errors else None)
    finally:
        info["stop"] = run.procs.stop(proc)
        log = ""
        for path in (stdout_path, stderr_path):  # vLLM logs INFO to stdout
            with open(path, errors="replace") as f:
                log += f.read()
        info["ddtree_log_lines"] = [line.strip()[:600] for line in log.splitlines()
                                    if "ddtree:" in line or "DDTree" in line][:40]


# --------------------------------------------------------------------------- plain server
def check_identical(run: Run, phase: str, name: str, cmp: dict) -> bool:
    """A strict check of a comparison's ``identical`` over its ``total``."""
    return run.check(phase, name, cmp["total"] > 0 and cmp["identical"] == cmp["total"],
                     message=f"{cmp['identical']}/{cmp['total']} identical")


# A greedy difference whose two tokens' logprobs under plain decoding lie this close is a
# near tie (bench/gpu_checks.py near_tie_margins: plain decoding's own logprobs move by up
# to 0.0092 between batch shapes in float32, bench/results/2026-12-01-lossless-seeded-*).
NEAR_TIE_LOGPROB_GAP = 1e-2


def first_divergences(pairs: dict, own: list) -> list[dict]:
    """Where each pair of greedy outputs first differs. ``pairs``: {label: [a, b]}, lists of
    token-id lists aligned with the prompts (None: no output); ``b`` None means ``own``
    (the worker's outputs). One entry per differing request: the position, the two
    tokens there (None where one output ends first) and the common prefix."""
    found = []
    for label, (a_list, b_list) in pairs.items():
        b_list = own if b_list is None else b_list
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            if a is None or b is None or a == b:
                continue
            d = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            found.append({"label": label, "request": i, "position": d,
                          "a_token": a[d] if d < len(a) else None,
                          "b_token": b[d] if d < len(b) else None, "prefix": a[:d]})
    return found


def margin_entry(div: dict, logprobs: dict | None, recomputed: int | None) -> dict:
    """A divergence with plain decoding's logprobs of its two tokens: the gap and whether
    it is a near tie (a length difference or a missing logprob has no margin)."""
    entry = {k: v for k, v in div.items() if k != "prefix"}
    a, b = div["a_token"], div["b_token"]
    entry["recomputed_token"] = recomputed
    if a is None or b is None or not logprobs or a not in logprobs or b not in logprobs:
        entry.update(logprob_gap=None, near_tie=False)
        return entry
    gap = logprobs[a] - logprobs[b]
    entry.update(logprob_gap=round(gap, 6), near_tie=abs(gap) <= NEAR_TIE_LOGPROB_GAP)
    return entry


def check_explained(run: Run, phase: str, name: str, cmp: dict, margins: list | None) -> bool:
    """Strict check of a greedy comparison: every differing request differs at a near tie
    of plain decoding. Without margins (no plain offline reference ran) only identical
    outputs pass."""
    head = f"{cmp['identical']}/{cmp['total']} identical"
    if margins is None:
        return check_identical(run, phase, name, cmp)
    different = cmp["total"] - cmp["identical"]
    untied = [m for m in margins if not m["near_tie"]]
    ok = cmp["total"] > 0 and not untied and len(margins) == different
    if ok:
        largest = max((abs(m["logprob_gap"]) for m in margins), default=0.0)
        message = (f"{head}; the {different} others first differ at near ties of plain "
                   f"decoding (|logprob gap| <= {NEAR_TIE_LOGPROB_GAP}, largest {largest:.3g})")
    elif untied:
        m = untied[0]
        gap = "no margin" if m["logprob_gap"] is None else f"logprob gap {m['logprob_gap']:.3g}"
        message = (f"{head}; {len(untied)} not at a near tie, e.g. request {m['request']} "
                   f"at token {m['position']}: {gap}")
    else:
        message = f"{head}; {len(margins)} margins for {different} differences"
    return run.check(phase, name, ok, message=message)


def as_reference(records: list[dict]) -> list[dict]:
    """Answered feature records in the offline reference's shape (for compare_features)."""
    return [{"check": r["check"], "token_ids": r["token_ids"], "logprobs": r["token_logprobs"],
             "prompt_logprobs": r["prompt_token_logprobs"]}
            for r in records if r.get("status") == 200 and r.get("token_ids")]


def run_plain_server(run: Run, prefix: list[str], load: list[dict]) -> None:
    """The plain-decoding control (``--plain-server``): vLLM's server on the same target
    with the same flags and no ``--speculative-config``, sent the same feature requests
    (at once) and the same greedy load; its answers compared token for token with the
    DDTree server's, and in the offline phase with plain decoding offline (how far the
    server's batching alone moves plain decoding)."""
    args = run.args
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = serve_command(prefix, args.target, None, port,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        max_model_len=args.max_model_len, dtype=args.dtype)
    stdout_path = os.path.join(args.log_dir, "plain-server.stdout.log")
    stderr_path = os.path.join(args.log_dir, "plain-server.stderr.log")
    info: dict = {"command": shlex.join(cmd), "logs": {"stdout": stdout_path, "stderr": stderr_path},
                  "startup": {}}
    run.result["plain_server"] = info
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        proc = run.procs.start(cmd, env=child_env(), stdout=out, stderr=err)
    try:
        if not wait_healthy(run, proc, base, args.startup_timeout, stderr_path,
                            phase="plain_server", into=info["startup"]):
            return
        reqs = feature_requests(SERVED_MODEL_NAME)
        records = asyncio.run(_send_features(base, reqs, args.request_timeout))
        for req, rec in zip(reqs, records):
            rec["check"] = feature_tag(req)
        prompts = [r["prompt"] for r in load]
        limit = load_deadline(run, max(len(prompts), 1))
        results, wall = asyncio.run(asyncio.wait_for(
            _load(base, prompts, args.concurrency, args.max_tokens, args.request_timeout), limit))
        mixed = None
        if run.feature_load:
            load_reqs = [req for req, _ in run.feature_load]
            mixed = asyncio.run(asyncio.wait_for(
                _send_features(base, load_reqs, args.request_timeout, args.concurrency),
                load_deadline(run, len(load_reqs))))
            for req, rec in zip(load_reqs, mixed):
                rec["check"] = feature_tag(req)
    finally:
        info["stop"] = run.procs.stop(proc)
    info["features"] = records
    info["load_token_ids"] = [None if r["error"] else r["token_ids"] for r in results]
    errors = [r for r in results if r["error"]]
    info["load"] = load_throughput(results, wall)
    run.check("plain_server", "load_zero_errors", not errors,
              message=errors[0]["error"] if errors else None)
    feats = compare_features(run.result.get("features") or [], as_reference(records))
    info["features_vs_ddtree"] = feats
    pairs = [(d["token_ids"], p["token_ids"]) for d, p in zip(load, results)
             if not d["error"] and not p["error"]]
    greedy = compare_greedy([a for a, _ in pairs], [b for _, b in pairs])
    info["greedy_vs_ddtree"] = greedy
    print(f"DDTree server vs plain server: features {feats['identical']}/{feats['total']} "
          f"identical (logprobs within {feats['max_logprob_abs_diff']}, prompt logprobs within "
          f"{feats['max_prompt_logprob_abs_diff']}), greedy load {greedy['identical']}/"
          f"{greedy['total']} identical", flush=True)
    if mixed is not None:
        info["feature_load_vs_ddtree"] = compare_features(
            [rec for _, rec in run.feature_load], as_reference(mixed))
        m = info["feature_load_vs_ddtree"]
        print(f"DDTree server vs plain server, feature load: {m['identical']}/{m['total']} "
              f"identical (logprobs within {m['max_logprob_abs_diff']})", flush=True)
    if args.strict_greedy:
        check_identical(run, "plain_server", "features_identical", feats)
        if mixed is not None:
            check_identical(run, "plain_server", "feature_load_identical",
                            info["feature_load_vs_ddtree"])
        if not explains_offline(args):
            check_identical(run, "plain_server", "greedy_matches", greedy)


def plain_server_vs_offline(run: Run, usable: list[dict], offline: dict) -> None:
    """The control: the plain server's greedy load and feature requests against plain
    decoding offline (the same comparison the DDTree server gets)."""
    plain = run.result.get("plain_server") or {}
    ids = plain.get("load_token_ids")
    if not ids:
        return
    pairs = [(ids[r["index"]], o) for r, o in zip(usable, offline["token_ids"])
             if r["index"] < len(ids) and ids[r["index"]] is not None]
    greedy = compare_greedy([a for a, _ in pairs], [b for _, b in pairs])
    feats = compare_features(plain.get("features") or [], offline.get("requests") or [])
    plain["greedy_vs_offline_no_spec"] = greedy
    plain["features_vs_offline_no_spec"] = feats
    print(f"plain server vs offline no-spec (control): greedy {greedy['identical']}/"
          f"{greedy['total']} identical, features {feats['identical']}/{feats['total']}",
          flush=True)


# --------------------------------------------------------------------------- offline reference
def offline_worker(spec_path: str, out_path: str) -> int:
    """Child mode: greedy generation with the server's engine settings, without
    speculation or with the spec's ``speculative_config`` (the server's)."""
    os.environ.update(SERVER_ENV)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams

    extra = {}
    if spec.get("attention_backend"):
        # The DDTree server verifies on TRITON_ATTN; the same backend here makes the
        # greedy comparison free of backend rounding differences.
        extra["attention_config"] = {"backend": spec["attention_backend"]}
    if spec.get("speculative_config"):
        extra["speculative_config"] = spec["speculative_config"]
    llm = LLM(model=spec["target"], enforce_eager=True,
              gpu_memory_utilization=spec["gpu_memory_utilization"],
              max_model_len=spec["max_model_len"], seed=0, dtype=spec.get("dtype", "auto"),
              max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], **extra)
    init_s = time.monotonic() - t0
    prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in spec["prompts"]]
    sp = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    t1 = time.monotonic()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    result = {"init_s": round(init_s, 1), "generate_s": round(time.monotonic() - t1, 2),
              "token_ids": [list(o.outputs[0].token_ids) for o in outs],
              "texts": [o.outputs[0].text for o in outs]}
    if spec.get("explain") is not None:
        result["margins"] = worker_margins(llm, spec, prompts, result["token_ids"])
    if spec.get("requests"):
        # The feature requests, all in one batch, each with its own sampling fields.
        from vllm.sampling_params import StructuredOutputsParams

        def params(fields: dict) -> SamplingParams:
            fields = dict(fields)
            if "structured_outputs" in fields:
                fields["structured_outputs"] = StructuredOutputsParams(
                    **fields["structured_outputs"])
            return SamplingParams(**fields)

        reqs = spec["requests"]
        outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs],
                            [params(r["params"]) for r in reqs], use_tqdm=False)
        result["requests"] = []
        for r, o in zip(reqs, outs):
            c = o.outputs[0]
            lps = ([float(step[t].logprob) for t, step in zip(c.token_ids, c.logprobs)]
                   if r["params"].get("logprobs") and c.logprobs else None)
            plps = ([None if e is None else float(e[t].logprob)
                     for e, t in zip(o.prompt_logprobs, r["prompt_token_ids"])]
                    if r["params"].get("prompt_logprobs") and o.prompt_logprobs else None)
            result["requests"].append({"check": r["check"], "token_ids": list(c.token_ids),
                                       "logprobs": lps, "prompt_logprobs": plps})
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


def worker_margins(llm, spec: dict, prompts: list, own: list) -> dict:
    """Plain decoding's logprobs of both tokens at every first divergence of
    ``spec["explain"]`` (prompt + common prefix, one greedy step), as margin entries
    by label."""
    from vllm import SamplingParams

    divs = first_divergences(spec["explain"], own)
    margins: dict = {label: [] for label in spec["explain"]}
    jobs = [d for d in divs if d["a_token"] is not None and d["b_token"] is not None
            and isinstance(prompts[d["request"]], dict)]
    outs = llm.generate(
        [{"prompt_token_ids": prompts[d["request"]]["prompt_token_ids"] + d["prefix"]}
         for d in jobs],
        [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                        logprob_token_ids=[d["a_token"], d["b_token"]]) for d in jobs],
        use_tqdm=False) if jobs else []
    by_id = {id(d): o.outputs[0] for d, o in zip(jobs, outs)}
    for d in divs:
        c = by_id.get(id(d))
        lps = None
        if c is not None and c.logprobs:
            first = c.logprobs[0]  # a mapping token id -> Logprob (as gpu_checks reads it)
            lps = {t: float(first[t].logprob) for t in (d["a_token"], d["b_token"])
                   if t in first}
        margins[d["label"]].append(margin_entry(d, lps, c.token_ids[0] if c else None))
    return margins


def offline_command(args: argparse.Namespace, spec_path: str, out_path: str) -> list[str]:
    prefix = (shlex.split(args.offline_cmd) if args.offline_cmd
              else [sys.executable, os.path.abspath(__file__), "--offline-worker"])
    return prefix + [spec_path, out_path]


def explains_offline(args: argparse.Namespace) -> bool:
    """Whether plain decoding offline will run and give the greedy differences' margins."""
    return not args.skip_offline and "no-spec" in args.offline_references


def run_offline(run: Run, load: list[dict]) -> None:
    # same-config first: the no-spec worker then explains its differences too.
    for reference in sorted(run.args.offline_references, key=lambda r: r != "same-config"):
        run_offline_reference(run, load, reference)
    if run.args.strict_greedy:
        strict_greedy_checks(run)


def aligned_plain_ids(run: Run, usable: list[dict]) -> list | None:
    """The plain server's greedy load outputs, aligned with ``usable``."""
    ids = (run.result.get("plain_server") or {}).get("load_token_ids")
    if not ids:
        return None
    return [ids[r["index"]] if r["index"] < len(ids) else None for r in usable]


def explain_pairs(run: Run, usable: list[dict]) -> dict:
    """The greedy comparisons whose differences the no-spec worker explains."""
    server = [r["token_ids"] for r in usable]
    pairs = {"ddtree_server": [server, None]}
    plain = aligned_plain_ids(run, usable)
    if plain is not None:
        pairs["plain_server"] = [plain, None]
        pairs["ddtree_server_vs_plain_server"] = [server, plain]
    if "same-config" in run.offline_ids:
        pairs["ddtree_server_vs_same_config"] = [server, run.offline_ids["same-config"]]
    return pairs


def strict_greedy_checks(run: Run) -> None:
    """``--strict-greedy``: each greedy comparison identical, or differing only at near
    ties of plain decoding (the no-spec worker's margins)."""
    margins = (run.result.get("greedy") or {}).get("margins")
    checks = [("greedy", "matches_no_spec", run.result.get("greedy"), "ddtree_server"),
              ("greedy", "matches_offline_same_config", run.result.get("greedy_same_config"),
               "ddtree_server_vs_same_config"),
              ("plain_server", "greedy_matches",
               (run.result.get("plain_server") or {}).get("greedy_vs_ddtree"),
               "ddtree_server_vs_plain_server")]
    for phase, name, cmp, label in checks:
        if not cmp or "identical" not in cmp:
            continue
        check_explained(run, phase, name, cmp,
                        margins.get(label, []) if margins is not None else None)


def run_offline_reference(run: Run, load: list[dict], reference: str) -> None:
    """Phase 6 for one reference: generate offline in a child process, compare."""
    args = run.args
    key = OFFLINE_RESULT_KEYS[reference]
    usable = [r for r in load if not r["error"]]
    if not usable:
        run.result[key] = {"reference": reference, "skipped": "no successful load requests"}
        return
    left = run.deadline.left() - 5
    if left < 30:
        run.result[key] = {"reference": reference,
                           "skipped": f"only {left:.0f} s of the time budget left"}
        print(f"offline reference {reference} skipped: time budget spent", flush=True)
        return
    spec = {"reference": reference, "target": args.target,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "max_model_len": args.max_model_len, "max_tokens": args.max_tokens,
            "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "dtype": args.dtype, "attention_backend": args.reference_attention_backend,
            "prompts": [r["prompt_token_ids"] or r["prompt"] for r in usable]}
    if reference == "no-spec":
        spec["requests"] = feature_reference_requests(run.result.get("features") or [])
        if run.feature_load:
            spec["requests"] += feature_reference_requests(
                [rec for _, rec in run.feature_load], [req for req, _ in run.feature_load])
        spec["explain"] = explain_pairs(run, usable)
    if reference == "same-config":
        # The server's speculative config; DDTree picks its attention backend itself.
        spec["speculative_config"] = run.result["server"]["speculative_config"]
        spec["attention_backend"] = None
    stem = "offline" if reference == "no-spec" else f"offline-{reference}"
    spec_path = os.path.join(args.log_dir, f"{stem}-spec.json")
    out_path = os.path.join(args.log_dir, f"{stem}-out.json")
    log_path = os.path.join(args.log_dir, f"{stem}.log")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    if os.path.exists(out_path):
        os.remove(out_path)
    cmd = offline_command(args, spec_path, out_path)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = run.procs.start(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=min(args.offline_timeout, left))
        except subprocess.TimeoutExpired:
            pass
        stop = run.procs.stop(proc, term_wait=10)
    info: dict = {"reference": reference, "seconds": round(time.monotonic() - t0, 1),
                  "returncode": proc.returncode, "log": log_path,
                  "prompts_as_token_ids": all(r["prompt_token_ids"] for r in usable)}
    if proc.returncode != 0 or not os.path.exists(out_path):
        info.update(error=f"offline reference {reference} did not finish",
                    log_tail=tail(log_path), stop=stop)
        run.result[key] = info
        run.check("greedy", f"offline_{reference}_ran", False, message=info["error"])
        return
    with open(out_path) as f:
        offline = json.load(f)
    run.offline_ids[reference] = offline["token_ids"]
    if "margins" in offline:
        info["margins"] = offline["margins"]
        for label, entries in offline["margins"].items():
            ties = sum(1 for m in entries if m["near_tie"])
            print(f"differences {label}: {len(entries)}, near ties of plain decoding {ties}",
                  flush=True)
    server_ids = [r["token_ids"] for r in usable]
    cmp = compare_greedy(server_ids, offline["token_ids"])
    texts_same = sum(r["text"] == t for r, t in zip(usable, offline["texts"]))
    info.update(cmp, init_s=offline.get("init_s"), generate_s=offline.get("generate_s"),
                identical_texts=texts_same,
                note="batched kernels may round differently and flip a near-tie argmax; "
                     "mismatches are reported, and fail the run only with --strict-greedy")
    if cmp["first_difference"]:
        i = cmp["first_difference"]["request"]
        cmp["first_difference"].update(prompt=usable[i]["prompt"][:200],
                                       server_text=usable[i]["text"][:300],
                                       offline_text=offline["texts"][i][:300])
    run.result[key] = info
    print(f"greedy vs offline {reference}: {cmp['identical']}/{cmp['total']} identical "
          "token sequences", flush=True)
    if reference == "no-spec":
        plain_server_vs_offline(run, usable, offline)
    if spec.get("requests"):
        sets = [("features", "feature requests", run.result.get("features") or [])]
        if run.feature_load:
            sets.append(("feature_load", "feature load", [rec for _, rec in run.feature_load]))
        for phase_name, what, records in sets:
            cmp = compare_features(records, offline.get("requests") or [])
            run.result[f"{phase_name}_vs_no_spec"] = cmp
            print(f"{what} vs offline {reference}: {cmp['identical']}/{cmp['total']} "
                  f"identical, logprobs within {cmp['max_logprob_abs_diff']}, prompt logprobs "
                  f"within {cmp['max_prompt_logprob_abs_diff']}", flush=True)
            if args.strict_greedy:
                check_identical(run, phase_name, "identical_to_no_spec", cmp)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.offline_worker:
        return offline_worker(*args.offline_worker)
    os.makedirs(args.log_dir, exist_ok=True)
    run = Run(args=args, deadline=Deadline(args.time_budget))
    run.result.update(
        command=shlex.join([sys.executable] + (sys.argv if argv is None else [__file__] + argv)),
        started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), time_budget_s=args.time_budget,
        served_model_name=SERVED_MODEL_NAME, timings={},
    )

    def watchdog() -> None:
        run.procs.kill_all()
        with run.lock:
            run.failures.append(f"watchdog: time budget {args.time_budget:.0f} s "
                                f"(+{WATCHDOG_GRACE_S:.0f} s grace) overrun")
        try:
            run.write()
        finally:
            print("watchdog fired: processes killed, partial results written", flush=True)
            os._exit(2)

    dog = threading.Timer(args.time_budget + WATCHDOG_GRACE_S, watchdog)
    dog.daemon = True
    dog.start()

    prefix = server_prefix(args.server_cmd)
    server = None
    load: list[dict] = []

    def phase(name: str, fn, *a):
        t = time.monotonic()
        try:
            return fn(*a)
        except Exception as exc:  # noqa: BLE001 - a crash in one phase is a failed check
            run.check(name, "no_exception", False, message=repr(exc))
            return None
        finally:
            run.result["timings"][name + "_s"] = round(time.monotonic() - t, 2)
            run.write()

    try:
        if not args.server_cmd:
            phase("probe", probe_vllm, run)
        if not args.skip_bad_configs:
            phase("bad_configs", run_bad_configs, run, prefix)
        if args.server_defaults:
            phase("server_defaults", run_server_defaults, run, prefix)
        if args.server_entrypoint:
            with tempfile.TemporaryDirectory(prefix="serve-e2e-") as tmp_dir:
                phase("server_entrypoint", run_server_entrypoint, run, prefix, tmp_dir)

        port = args.port or free_port()
        base = f"http://127.0.0.1:{port}"
        spec = speculative_config(args.drafter, args.budget, ddtree_max_depth=args.max_depth)
        cmd = serve_command(prefix, args.target, spec, port,
                            gpu_memory_utilization=args.gpu_memory_utilization,
                            max_model_len=args.max_model_len, dtype=args.dtype)
        stdout_path = os.path.join(args.log_dir, "server.stdout.log")
        stderr_path = os.path.join(args.log_dir, "server.stderr.log")
        run.result["server"] = {"command": shlex.join(cmd), "env": SERVER_ENV, "base_url": base,
                                "speculative_config": spec,
                                # Server and offline reference inherit it (exact greedy
                                # comparison under load: docs/operations.md).
                                "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT") == "1",
                                "logs": {"stdout": stdout_path, "stderr": stderr_path}}
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            server = run.procs.start(cmd, env=child_env(), stdout=out, stderr=err)
        healthy = phase("startup", wait_healthy, run, server, base, args.startup_timeout, stderr_path)
        if healthy:
            phase("endpoints", check_endpoints, run, base)
            phase("bad_requests", check_bad_requests, run, base)
            phase("features", check_features, run, base)
            load = phase("load", run_load, run, base) or []
            if args.feature_load:
                phase("feature_load", run_feature_load, run, base)
            phase("metrics", check_metrics, run, base, "after_load", True)
        run.result["server"]["stop"] = run.procs.stop(server)
        server = None
        if healthy and args.plain_server and load:
            phase("plain_server", run_plain_server, run, prefix, load)
        if healthy and not args.skip_offline:
            phase("offline", run_offline, run, load)
    finally:
        if server is not None:
            run.result.setdefault("server", {})["stop"] = run.procs.stop(server)
        run.procs.kill_all()
        dog.cancel()
        run.write()

    print_summary(run.result)
    return 0 if not run.failures else 1


def print_summary(result: dict) -> None:
    print("=" * 72)
    for phase, checks in (result.get("checks") or {}).items():
        good = sum(c["ok"] for c in checks)
        print(f"{phase:14s} {good}/{len(checks)} ok" +
              "".join(f"\n    FAIL {c['name']}: {c.get('message') or c.get('error') or ''}"
                      for c in checks if not c["ok"]))
    metrics = (result.get("spec_decode_metrics") or {}).get("after_load") or {}
    if metrics:
        print(f"spec decode: drafts={metrics.get('num_drafts')} "
              f"accepted={metrics.get('num_accepted_tokens')} "
              f"mean acceptance length={metrics.get('mean_acceptance_length')}")
    load = result.get("load") or {}
    if load:
        print(f"load: {load.get('num_requests')} req, errors={load.get('errors')}, "
              f"{load.get('output_tokens_per_s')} tok/s, p50={load['latency'].get('p50_s')} s, "
              f"p99={load['latency'].get('p99_s')} s")
    for reference, key in OFFLINE_RESULT_KEYS.items():
        greedy = result.get(key) or {}
        if greedy:
            print(f"greedy vs offline {reference}: " + (
                greedy.get("skipped") or greedy.get("error") or
                f"{greedy.get('identical')}/{greedy.get('total')} identical"))
    plain = result.get("plain_server") or {}
    for name, key in (("DDTree server", "greedy_vs_ddtree"),
                      ("offline no-spec", "greedy_vs_offline_no_spec")):
        if plain.get(key):
            print(f"plain server vs {name}: {plain[key]['identical']}/{plain[key]['total']} "
                  "identical greedy")
    print(f"timings: {result.get('timings')}")
    print("PASSED" if result.get("passed") else f"FAILED: {result.get('failures')}")


if __name__ == "__main__":
    sys.exit(main())
