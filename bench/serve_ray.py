"""DDTree on vLLM's Ray executor, started the way the multi-node overlay starts it.

The overlay (``deploy/k8s/overlays/multi-node-ray``) runs one LeaderWorkerSet group per
model replica: the leader pod runs its ``args`` script (``ray start --head``, then the
image's entrypoint, which builds ``vllm serve`` from the ConfigMap's variables), and
each worker pod runs its own (``ray start --address=$LWS_LEADER_ADDRESS:6379 --block``).
This script runs those two scripts as they are written in ``leaderworkerset.yaml``, on
one host with ``--gpus-per-node`` GPUs each (``CUDA_VISIBLE_DEVICES``: two Ray nodes on
one host), with the ConfigMap's variables (the base's ``ddtree.env`` and the overlay's
literals). What differs from a cluster, each recorded in ``substitutions``: the model
paths, ``TENSOR_PARALLEL_SIZE`` (the overlay's 16 is 2 pods x 8 GPUs), the
entrypoint's path in the image (this checkout's ``deploy/entrypoint.sh``),
``LWS_LEADER_ADDRESS`` (127.0.0.1) and ``EXTRA_ARGS`` (``--dtype float32`` for exact
comparisons, and a seed).

Then, through the OpenAI server: ``--num-prompts`` completions, greedy and seeded
(temperature 1, a seed per request), one at a time (batch 1) and all at once, with
DDTree; the cluster is stopped and started again by the same scripts without the
drafter variables (the entrypoint then serves without speculation), the same requests
are sent, and the token ids must be identical. Each rank traces what it verified
(``VLLM_DDTREE_RANK_TRACE``, ``vllm_ddtree.rank_trace``): the traces must agree.

    PYTHONPATH=.:/opt/vllm-site python3 bench/serve_ray.py --target DIR --drafter DIR \\
        --overlay deploy/k8s/overlays/multi-node-ray --out $OUT/serve-ray-tp2.json --log-dir $OUT/ray

Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.run import first_difference  # noqa: E402
from bench.serve_e2e import (  # noqa: E402
    IMAGE_ENV, Deadline, Run, builtin_prompts, child_env, http, read_env_file,
    spec_decode_summary, wait_healthy,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRYPOINT = os.path.join(ROOT, "deploy", "entrypoint.sh")
# Where the image keeps the entrypoint (Dockerfile), as the overlay's leader calls it.
IMAGE_ENTRYPOINT = "/opt/vllm-ddtree/deploy/entrypoint.sh"
RAY_PORT = 6379
# The variables that make the entrypoint serve with DDTree; the plain server has none.
DRAFTER_VARIABLES = ("DDTREE_DRAFTER", "DDTREE_BUDGET", "DDTREE_MAX_DEPTH",
                     "DDTREE_TOKENS_PER_STEP", "DDTREE_DISABLE_BY_BATCH_SIZE",
                     "SPECULATIVE_CONFIG")
SAMPLING = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 1.0}}


def overlay_commands(overlay: str) -> dict:
    """The overlay's leader and worker scripts (``args`` of each template's container)
    and its ConfigMap: the base's env file with the overlay's literals merged in."""
    import yaml

    with open(os.path.join(overlay, "kustomization.yaml")) as f:
        kustomization = yaml.safe_load(f)
    with open(os.path.join(overlay, "leaderworkerset.yaml")) as f:
        lws = yaml.safe_load(f)
    template = lws["spec"]["leaderWorkerTemplate"]

    def script(role: str) -> str:
        containers = template[role]["spec"]["containers"]
        if len(containers) != 1 or containers[0].get("command") != ["/bin/bash", "-c"]:
            raise ValueError(f"{overlay}: {role}: expected one container running bash -c")
        return containers[0]["args"][0]

    env: dict[str, str] = {}
    for base in kustomization.get("resources", []):
        base_dir = os.path.normpath(os.path.join(overlay, base))
        path = os.path.join(base_dir, "kustomization.yaml")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            base_kustomization = yaml.safe_load(f)
        for gen in base_kustomization.get("configMapGenerator", []):
            for envs in gen.get("envs", []):
                env.update(read_env_file(os.path.join(base_dir, envs)))
    for gen in kustomization.get("configMapGenerator", []):
        for literal in gen.get("literals", []):
            key, _, value = literal.partition("=")
            env[key] = value
    return dict(leader=script("leaderTemplate"), worker=script("workerTemplate"), env=env,
                group_size=template["size"])


def shim_dir(tmp: str) -> str:
    """``vllm`` and ``ray`` on the PATH as the image's console scripts run them."""
    bin_dir = os.path.join(tmp, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    for name, module in (("vllm", "vllm.entrypoints.cli.main"), ("ray", "ray.scripts.scripts")):
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write(f"#!/usr/bin/env bash\nexec {shlex.quote(sys.executable)} -m {module} \"$@\"\n")
        os.chmod(path, 0o755)
    return bin_dir


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def ray_stop(env: dict, log) -> None:
    subprocess.run(["ray", "stop", "--force"], env=env, stdout=log, stderr=subprocess.STDOUT,
                   timeout=120, check=False)


async def _complete(base: str, model: str, prompts: list[str], mode: str, concurrency: int,
                    max_tokens: int, timeout_s: float) -> list[dict]:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)

    async def one(session, i: int, prompt: str) -> dict:
        body = dict(model=model, prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                    return_token_ids=True, **SAMPLING[mode])
        if mode != "greedy":
            body["seed"] = 1000 + i
        async with sem:
            try:
                async with session.post(base + "/v1/completions", json=body,
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        return {"index": i, "error": f"HTTP {resp.status}: {text[:300]}"}
                    choice = json.loads(text)["choices"][0]
                    return {"index": i, "token_ids": choice.get("token_ids")}
            except Exception as exc:  # noqa: BLE001 - recorded as this request's error
                return {"index": i, "error": repr(exc)}

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session, i, p) for i, p in enumerate(prompts))))


class Cluster:
    """One LeaderWorkerSet group on this host: the leader's and the workers' scripts."""

    def __init__(self, run: Run, overlay: dict, env: dict, name: str):
        self.args, self.procs = run.args, run.procs
        self.overlay, self.env, self.name = overlay, env, name
        self.leader = None
        self.workers: list = []
        self.logs: dict[str, str] = {}

    def _start(self, role: str, script: str, gpus: str, extra: dict) -> subprocess.Popen:
        env = dict(self.env, CUDA_VISIBLE_DEVICES=gpus, **extra)
        out = os.path.join(self.args.log_dir, f"{self.name}-{role}.log")
        self.logs[role] = out
        with open(out, "wb") as f:
            return self.procs.start(["bash", "-c", script], env=env, stdout=f,
                                    stderr=subprocess.STDOUT)

    def start(self, deadline: Deadline) -> dict:
        per = self.args.gpus_per_node
        gpus = [",".join(str(g) for g in range(k * per, (k + 1) * per))
                for k in range(self.overlay["group_size"])]
        t0 = time.monotonic()
        self.leader = self._start("leader", self.leader_script(), gpus[0], {})
        end = time.monotonic() + deadline.bound(120)
        while not port_open(RAY_PORT) and time.monotonic() < end and self.leader.poll() is None:
            time.sleep(1)
        head_s = round(time.monotonic() - t0, 1)
        for k, g in enumerate(gpus[1:], 1):
            self.workers.append(self._start(f"worker-{k}", self.overlay["worker"], g,
                                            {"LWS_LEADER_ADDRESS": "127.0.0.1"}))
        return dict(gpus=gpus, ray_head_s=head_s, ray_head_up=port_open(RAY_PORT))

    def leader_script(self) -> str:
        return self.overlay["leader"].replace(IMAGE_ENTRYPOINT, ENTRYPOINT)

    def ray_status(self) -> str:
        try:
            return subprocess.run(["ray", "status"], env=self.env, capture_output=True, text=True,
                                  timeout=60).stdout[-3000:]
        except Exception as exc:  # noqa: BLE001 - informative
            return repr(exc)

    def stop(self, log) -> dict:
        info = {"leader": self.procs.stop(self.leader) if self.leader else None,
                "workers": [self.procs.stop(w) for w in self.workers]}
        ray_stop(self.env, log)
        return info


def serve_and_ask(run: Run, overlay: dict, env: dict, name: str,
                  prompts: list[str]) -> dict | None:
    """Start the group with ``env``, wait for the server (check ``<name>/server_healthy``),
    send every (mode, batch) request set; the answers by "mode/batch", or None when the
    server never came up."""
    args, deadline = run.args, run.deadline
    cluster = Cluster(run, overlay, env, name)
    info = run.result.setdefault("servers", {}).setdefault(name, {})
    base = f"http://127.0.0.1:{env.get('PORT') or IMAGE_ENV['PORT']}"
    with open(os.path.join(args.log_dir, f"{name}-ray-stop.log"), "wb") as stop_log:
        try:
            info["start"] = cluster.start(deadline)
            info["startup"] = {}
            if not wait_healthy(run, cluster.leader, base, args.startup_timeout,
                                cluster.logs["leader"], phase=name, into=info["startup"]):
                return None
            info["ray_status"] = cluster.ray_status()
            models = http("GET", base + "/v1/models", timeout=10).json() or {}
            model = (models.get("data") or [{}])[0].get("id", args.target)
            answers = {}
            for mode in SAMPLING:
                for batch in args.batch_sizes:
                    t = time.monotonic()
                    got = asyncio.run(_complete(base, model, prompts, mode, batch,
                                                args.max_tokens, deadline.bound(180)))
                    answers[f"{mode}/{batch}"] = got
                    info.setdefault("seconds", {})[f"{mode}/{batch}"] = round(time.monotonic() - t, 2)
            metrics = http("GET", base + "/metrics", timeout=10)
            info["spec_decode"] = spec_decode_summary(metrics.body) if metrics.status == 200 else None
            return answers
        finally:
            info["stop"] = cluster.stop(stop_log)
            info["logs"] = cluster.logs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--overlay", default=os.path.join(ROOT, "deploy/k8s/overlays/multi-node-ray"))
    p.add_argument("--tp", type=int, default=2, help="TENSOR_PARALLEL_SIZE on this host")
    p.add_argument("--gpus-per-node", type=int, default=1, help="GPUs each pod (Ray node) gets")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16],
                   help="requests in flight at once (1: one after another)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--time-budget", type=float, default=520.0)
    p.add_argument("--out", required=True)
    p.add_argument("--log-dir", required=True)
    args = p.parse_args(argv)
    os.makedirs(args.log_dir, exist_ok=True)
    run = Run(args=args, deadline=Deadline(args.time_budget))
    overlay = overlay_commands(args.overlay)
    tmp = tempfile.mkdtemp(prefix="serve-ray-")
    trace_dir = os.path.join(tmp, "rank-trace")
    substitutions = {
        "MODEL": args.target, "DDTREE_DRAFTER": args.drafter,
        "TENSOR_PARALLEL_SIZE": str(args.tp),
        "EXTRA_ARGS": f"--dtype {args.dtype} --seed 0",
    }
    env = child_env()
    env.update(IMAGE_ENV)
    env.update(overlay["env"])
    env.update(substitutions)
    env["PATH"] = shim_dir(tmp) + os.pathsep + env.get("PATH", "")
    env["VLLM_DDTREE_RANK_TRACE"] = trace_dir
    prompts = builtin_prompts()[: args.num_prompts]
    run.result.update(
        command=shlex.join([sys.executable] + (sys.argv if argv is None else [__file__] + argv)),
        overlay=args.overlay, leader_script=overlay["leader"], worker_script=overlay["worker"],
        configmap=overlay["env"], substitutions=dict(
            substitutions, entrypoint=f"{IMAGE_ENTRYPOINT} -> {ENTRYPOINT}",
            LWS_LEADER_ADDRESS="127.0.0.1",
            gpus=f"{overlay['group_size']} Ray nodes x {args.gpus_per_node} GPU on one host"),
        dtype=args.dtype, max_tokens=args.max_tokens, batch_sizes=args.batch_sizes,
        num_prompts=len(prompts))

    with open(os.path.join(args.log_dir, "ray-stop-before.log"), "wb") as log:
        ray_stop(env, log)  # nothing of an earlier run left on the ports
    try:
        ddtree = serve_and_ask(run, overlay, env, "ddtree", prompts)
        run.write()
        if ddtree is None:
            return 1
        if os.path.isdir(trace_dir):
            from vllm_ddtree.rank_trace import compare_rank_traces

            trace = compare_rank_traces(trace_dir)
            run.result["rank_trace"] = trace
            run.check("ddtree", "ranks_verified_the_same_trees",
                      trace["identical"] and len(trace["ranks"]) == args.tp,
                      ranks=trace["ranks"], steps=trace["steps"],
                      first_difference=trace["first_difference"])
        else:
            run.check("ddtree", "ranks_verified_the_same_trees", False,
                      message=f"no rank traces in {trace_dir}")
        plain_env = {k: v for k, v in env.items() if k not in DRAFTER_VARIABLES}
        plain_env.pop("VLLM_DDTREE_RANK_TRACE")
        plain = serve_and_ask(run, overlay, plain_env, "no-spec", prompts)
        if plain is None:
            return 1
        cases = []
        for key, answers in ddtree.items():
            mode, batch = key.split("/")
            ref = plain[key]
            errors = [a.get("error") for a in answers + ref if a.get("error")]
            diffs = [dict(request=a["index"],
                          token=first_difference(a.get("token_ids") or [], b.get("token_ids") or []))
                     for a, b in zip(answers, ref) if a.get("token_ids") != b.get("token_ids")]
            identical = sum(a.get("token_ids") == b.get("token_ids") and a.get("token_ids") is not None
                            for a, b in zip(answers, ref))
            case = dict(target=os.path.basename(args.target.rstrip("/")), method="ddtree",
                        executor="ray", tp=args.tp, dtype=args.dtype, graphs=True,
                        batch=int(batch), sampling=mode, temperature=SAMPLING[mode]["temperature"],
                        seeded=mode != "greedy", scenario="openai-server", identical=identical,
                        total=len(answers), errors=errors[:3], differences=diffs)
            cases.append(case)
            run.check("compare", f"identical_{mode}_batch_{batch}",
                      identical == len(answers) and not errors,
                      message=f"{identical}/{len(answers)} identical")
        run.result["cases"] = cases
        return 0 if not run.failures else 1
    finally:
        run.procs.kill_all()
        with open(os.path.join(args.log_dir, "ray-stop-after.log"), "wb") as log:
            ray_stop(env, log)
        run.write()


if __name__ == "__main__":
    sys.exit(main())
