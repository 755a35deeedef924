"""deploy/k8s: render each kustomization, validate, scan, and check what ties the pieces together."""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest
import yaml

from lint_tools import ROOT, kubectl, run, tool

K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = {"base": K8S / "base", "tensor-parallel": K8S / "overlays" / "tensor-parallel",
                  "multi-node-ray": K8S / "overlays" / "multi-node-ray"}
LWS_API = "leaderworkerset.x-k8s.io/v1"
_rendered: dict[str, str] = {}


def rendered(name: str) -> str:
    if name not in _rendered:
        result = run([kubectl(), "kustomize", str(KUSTOMIZATIONS[name])], timeout=120)
        assert result.returncode == 0, f"kubectl kustomize {name}: {result.stderr}"
        _rendered[name] = result.stdout
    return _rendered[name]


def objects(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(rendered(name)) if doc]


def one(name: str, kind: str) -> dict:
    found = [o for o in objects(name) if o["kind"] == kind]
    assert len(found) == 1, f"{name}: {len(found)} {kind} objects"
    return found[0]


def pod_specs(name: str) -> dict[str, dict]:
    """Every pod template of a rendering, by a readable name."""
    specs = {}
    for obj in objects(name):
        if obj["kind"] == "Deployment":
            specs["deployment"] = obj["spec"]["template"]
        elif obj["kind"] == "LeaderWorkerSet":
            template = obj["spec"]["leaderWorkerTemplate"]
            specs["leader"] = template["leaderTemplate"]
            specs["worker"] = template["workerTemplate"]
    return specs


def config_env(name: str) -> dict[str, str]:
    return one(name, "ConfigMap")["data"]


def test_every_directory_has_a_kustomization():
    for path in KUSTOMIZATIONS.values():
        assert (path / "kustomization.yaml").is_file()
    assert {p.name for p in (K8S / "overlays").iterdir()} == {"tensor-parallel", "multi-node-ray"}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_core_objects_validate_against_the_kubernetes_schemas(tmp_path, name):
    core = [o for o in objects(name) if o["apiVersion"] != LWS_API]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(core))
    result = run([tool("kubernetes-validate"), "--strict", "-k", "1.32.0", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARN" not in result.stdout + result.stderr, result.stdout + result.stderr
    assert result.stdout.count("passed for resource") == len(core)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_pods_are_locked_down_and_probed(name):
    specs = pod_specs(name)
    assert specs, f"{name}: no pod template"
    for role, template in specs.items():
        spec = template["spec"]
        where = f"{name}/{role}"
        assert spec["automountServiceAccountToken"] is False, where
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["runAsUser"] >= 10000, where
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
        (container,) = spec["containers"]
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True, where
        assert security["capabilities"]["drop"] == ["ALL"], where
        assert container["image"].startswith("vllm-ddtree:"), where
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and "/dev/shm" in mounts, where
        assert mounts["/models"]["readOnly"] is True, where
        assert volumes["models"]["persistentVolumeClaim"]["readOnly"] is True, where
        for writable in ("/home/vllm/.cache", "/home/vllm/.config", "/tmp"):
            assert "emptyDir" in volumes[mounts[writable]["name"]], f"{where}: {writable}"
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus, where
        assert container["envFrom"][0]["configMapRef"]["name"] == one(name, "ConfigMap")["metadata"]["name"], where
        if role == "worker":
            continue
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, f"{where} {probe}"
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60, "model load + graph capture"
        assert {"name": "http", "containerPort": 8000} in container["ports"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_service_and_budget_select_the_pods(name):
    service = one(name, "Service")
    assert service["spec"]["ports"][0]["port"] == 8000
    budget = one(name, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
    specs = pod_specs(name)
    for role, template in specs.items():
        labels = template["metadata"]["labels"]
        assert budget.items() <= labels.items(), f"{name}/{role} not covered by the PodDisruptionBudget"
        serves = service["spec"]["selector"].items() <= labels.items()
        assert serves == (role != "worker"), f"{name}/{role}: Service selection"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_entrypoint_accepts_the_rendered_configuration(name, tmp_path):
    env = dict(config_env(name))
    for key in ("MODEL", "DDTREE_DRAFTER"):
        (tmp_path / key).mkdir()
        env[key] = str(tmp_path / key)  # the volume is not mounted here
    result = subprocess.run(["bash", str(ROOT / "deploy" / "entrypoint.sh"), "--print"],
                            env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout)
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config["method"] == "ddtree" and config["num_speculative_tokens"] == int(env["DDTREE_BUDGET"])
    if env.get("DDTREE_TOKENS_PER_STEP"):
        assert config["ddtree_tokens_per_step"] == int(env["DDTREE_TOKENS_PER_STEP"])
    tp = int(argv[argv.index("--tensor-parallel-size") + 1])
    specs = pod_specs(name)
    per_pod = int(next(iter(specs.values()))["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    if name == "multi-node-ray":
        lws = one(name, "LeaderWorkerSet")
        assert tp == per_pod * lws["spec"]["leaderWorkerTemplate"]["size"]
        assert argv[argv.index("--distributed-executor-backend") + 1] == "ray"
        assert argv[argv.index("--pipeline-parallel-size") + 1] == "1"
    else:
        assert tp == per_pod


def test_tensor_parallel_overlay_uses_more_gpus_and_shared_memory():
    base = pod_specs("base")["deployment"]["spec"]
    tp = pod_specs("tensor-parallel")["deployment"]["spec"]
    assert int(tp["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) > 1
    size = {name: {v["name"]: v for v in spec["volumes"]}["dshm"]["emptyDir"]["sizeLimit"]
            for name, spec in (("base", base), ("tp", tp))}
    assert int(size["tp"].rstrip("Gi")) > int(size["base"].rstrip("Gi"))


def test_leaderworkerset_structure():
    objs = objects("multi-node-ray")
    assert not [o for o in objs if o["kind"] == "Deployment"], "the LWS replaces the Deployment"
    lws = one("multi-node-ray", "LeaderWorkerSet")
    assert lws["apiVersion"] == LWS_API
    assert lws["metadata"]["namespace"] == one("multi-node-ray", "Service")["metadata"]["namespace"]
    spec = lws["spec"]
    assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1
    assert spec["startupPolicy"] in ("LeaderCreated", "LeaderReady")
    template = spec["leaderWorkerTemplate"]
    assert set(template) == {"size", "restartPolicy", "leaderTemplate", "workerTemplate"}
    assert isinstance(template["size"], int) and template["size"] >= 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    leader_script = leader["args"][0]
    assert leader["command"] == worker["command"] == ["/bin/bash", "-c"]
    assert "ray start --head --port=6379" in leader_script
    assert leader_script.rstrip().endswith("exec /opt/vllm-ddtree/deploy/entrypoint.sh")
    assert "LWS_LEADER_ADDRESS" in worker["args"][0]
    assert 'ray start --address="$leader:6379" --block' in worker["args"][0]
    # The shell scripts in args are valid bash.
    for script in (leader_script, worker["args"][0]):
        assert subprocess.run(["bash", "-n", "-c", script], capture_output=True).returncode == 0
    assert one("multi-node-ray", "ConfigMap")["data"]["PIPELINE_PARALLEL_SIZE"] == "1"


def test_group_network_policy_lets_the_ray_pods_talk():
    policies = {o["metadata"]["name"]: o for o in objects("multi-node-ray") if o["kind"] == "NetworkPolicy"}
    group = policies["vllm-ddtree-group"]["spec"]
    selector = group["podSelector"]["matchLabels"]
    for template in pod_specs("multi-node-ray").values():
        assert selector.items() <= template["metadata"]["labels"].items()
    assert group["ingress"] == [{"from": [{"podSelector": {"matchLabels": selector}}]}]


def test_checkov_kustomize():
    result = run([tool("checkov"), "--quiet", "--compact", "--skip-download", "--framework", "kustomize",
                  "-o", "json", "-d", str(K8S)], timeout=300)
    report = json.loads(result.stdout)
    reports = report if isinstance(report, list) else [report]
    assert result.returncode == 0 and all(r["summary"]["failed"] == 0 for r in reports), result.stdout
    # Each of the three renderings was really scanned (checkov silently finds nothing without kubectl).
    assert sum(r["summary"]["passed"] for r in reports) >= 3 * 50, result.stdout[:2000]


def test_yamllint():
    result = run([tool("yamllint"), "--strict", "--config-file", str(ROOT / ".yamllint"),
                  str(K8S), str(ROOT / ".github"), str(ROOT / ".yamllint")])
    assert result.returncode == 0, result.stdout + result.stderr
