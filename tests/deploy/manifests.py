"""The Kubernetes manifests as the tests read them: the objects kustomization.yaml lists,
in order, and small lookups over them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "platform" / "deploy"
KUBERNETES = DEPLOY / "kubernetes"


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())


def objects() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in kustomization()["resources"]:
        out += [d for d in yaml.safe_load_all((KUBERNETES / name).read_text()) if d]
    return out


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in objects() if d["kind"] == kind]


def pod_templates() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, its pod template) for every Deployment and Job."""
    for doc in objects():
        if doc["kind"] in ("Deployment", "Job"):
            yield doc, doc["spec"]["template"]


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    wanted = selector.get("matchLabels", {})
    return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())
