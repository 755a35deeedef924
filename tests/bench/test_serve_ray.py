"""bench/serve_ray.py: the multi-node overlay's own commands and variables are what runs."""

import os
from types import SimpleNamespace

from bench.serve_ray import ENTRYPOINT, IMAGE_ENTRYPOINT, Cluster, overlay_commands

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OVERLAY = os.path.join(ROOT, "deploy", "k8s", "overlays", "multi-node-ray")


def test_overlay_commands_are_the_manifests():
    got = overlay_commands(OVERLAY)
    assert "ray start --head --port=6379" in got["leader"]
    assert f"exec {IMAGE_ENTRYPOINT}" in got["leader"]
    assert 'ray start --address="$leader:6379" --block' in got["worker"]
    assert "LWS_LEADER_ADDRESS" in got["worker"]
    assert got["group_size"] == 2
    env = got["env"]
    # The overlay's literals over the base's env file.
    assert env["DISTRIBUTED_EXECUTOR_BACKEND"] == "ray"
    assert env["TENSOR_PARALLEL_SIZE"] == "16"
    assert env["DDTREE_BUDGET"] and env["DDTREE_DRAFTER"] and env["MODEL"]


def test_leader_runs_this_checkouts_entrypoint():
    overlay = overlay_commands(OVERLAY)
    run = SimpleNamespace(args=None, procs=None)
    cluster = Cluster(run, overlay, {}, "ddtree")
    script = cluster.leader_script()
    assert IMAGE_ENTRYPOINT not in script and f"exec {ENTRYPOINT}" in script
    assert os.path.isfile(ENTRYPOINT)
