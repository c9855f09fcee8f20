"""The Kubernetes manifests stay consistent with the code: they parse, every KEDA
ScaledObject scales a worker Deployment defined beside it, on the metric the autoscaler
publishes, for the model that worker serves; every command is one the project has."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from django.core.management import get_commands

from sluice.servers import DEFAULT, http_command

MANIFESTS = Path(__file__).resolve().parents[2] / "platform" / "deploy" / "kubernetes"


def _docs() -> list[dict]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_scaled_objects_follow_the_autoscalers_decision() -> None:
    docs = _docs()
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    assert scaled
    for obj in scaled:
        target = deployments[obj["spec"]["scaleTargetRef"]["name"]]
        command = target["spec"]["template"]["spec"]["containers"][0]["command"]
        served = command[command.index("--deployment") + 1]
        query = obj["spec"]["triggers"][0]["metadata"]["query"]
        match = re.fullmatch(r'max\(sluice_autoscaler_desired_replicas\{deployment="([^"]+)"\}\)',
                             query)
        assert match and match.group(1) == served
        assert obj["spec"]["minReplicaCount"] == 0  # scale to zero is the autoscaler's call


def test_every_command_exists() -> None:
    commands = get_commands()
    for doc in _docs():
        if doc["kind"] != "Deployment":
            continue
        command = doc["spec"]["template"]["spec"]["containers"][0]["command"]
        if command[1] == "manage.py":
            assert command[2] in commands, command
        env = doc["spec"]["template"]["spec"]["containers"][0]["envFrom"]
        assert env == [{"secretRef": {"name": "sluice-env"}}]


def test_the_gateway_runs_the_run_commands_server() -> None:
    """The gateway container's command is the run command's (sluice.servers), so a
    change of server or of its settings reaches Kubernetes too."""
    gateway = next(d for d in _docs() if d["kind"] == "Deployment"
                   and d["metadata"]["name"] == "sluice-gateway")
    command = gateway["spec"]["template"]["spec"]["containers"][0]["command"]
    expected = http_command(DEFAULT, "sluice.root.asgi:application", host="0.0.0.0",  # noqa: S104
                            port=8000)
    assert command[1:] == expected[1:]  # the interpreter's path aside
