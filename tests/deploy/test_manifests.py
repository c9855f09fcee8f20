"""The Kubernetes manifests deploy: every object validates offline against the Kubernetes
API's schemas (kubernetes-validate ships them) and KEDA's ScaledObject against KEDA's
own model (cloudcoil-models-keda, generated from its CRD); and they hold the rules a
production deployment needs: probes on the endpoints that exist, requests and limits,
disruption budgets, network policies, non-root pods and secrets only by reference."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import pytest
from django.urls import resolve

from inference.autoscaler import HUNG_AFTER_S
from tests.deploy.manifests import KUBERNETES, matches, objects, of_kind, pod_templates

KUBERNETES_VERSION = "1.32"  # the oldest minor these manifests promise to work on
SECRET_NAME = re.compile(r"KEY|SECRET|PASSWORD|TOKEN|DATABASE_URL|REDIS_URL", re.I)


def test_every_object_validates_against_the_kubernetes_schemas() -> None:
    validate = pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate is not installed (a dev dependency: "
               "`pip install kubernetes-validate`); the API schemas ship inside it").validate
    checked = 0
    for doc in objects():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: checked against KEDA's model below
        validate(doc, KUBERNETES_VERSION, strict=True)  # strict: unknown fields fail too
        checked += 1
    assert checked >= 20


def test_a_wrong_field_is_caught() -> None:
    """The validator is not a rubber stamp: the same manifest with a misspelt field and
    a string where a number belongs is refused."""
    k8s = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate missing")
    gateway = next(d for d in of_kind("Deployment") if d["metadata"]["name"] == "sluice-gateway")
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(k8s.ValidationError):
        k8s.validate(gateway, KUBERNETES_VERSION, strict=True)
    del container["readinessProbe"]["periodSecond"]
    gateway["spec"]["replicas"] = "two"
    with pytest.raises(k8s.ValidationError):
        k8s.validate(gateway, KUBERNETES_VERSION, strict=True)


def test_scaled_objects_validate_against_kedas_model() -> None:
    keda = pytest.importorskip(
        "cloudcoil.models.keda.v1alpha1",
        reason="cloudcoil-models-keda is not installed (a dev dependency: `pip install "
               "cloudcoil-models-keda`); KEDA's CRD schema as typed models")
    scaled = of_kind("ScaledObject")
    assert scaled
    for doc in scaled:
        model = keda.ScaledObject.model_validate(doc)
        # Unknown fields are dropped by the model: what comes back must be all there was.
        assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == doc
    broken = {**scaled[0], "spec": {**scaled[0]["spec"], "minReplicaCount": "zero"}}
    with pytest.raises(ValueError, match="minReplicaCount"):
        keda.ScaledObject.model_validate(broken)


def test_kustomize_renders_every_object_into_the_namespace() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here to render the kustomization")
    out = subprocess.run([kubectl, "kustomize", str(KUBERNETES)], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    import yaml

    rendered = [d for d in yaml.safe_load_all(out) if d]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in objects())
    for doc in rendered:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "sluice", doc["metadata"]


def test_servers_probe_the_endpoints_that_exist() -> None:
    for workload, template in pod_templates():
        for container in template["spec"]["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                path = container.get(probe, {}).get("httpGet", {}).get("path")
                if path:
                    resolve(path)  # a route of the platform's URLconf, or Resolver404
        ports = [p for c in template["spec"]["containers"] for p in c.get("ports", [])]
        if ports:  # a server: it says when it is ready and when it is stuck
            container = template["spec"]["containers"][0]
            assert {"readinessProbe", "livenessProbe"} <= set(container), workload["metadata"]


def test_the_worker_probe_waits_as_long_as_the_autoscaler_would() -> None:
    for deployment in of_kind("Deployment"):
        command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
        if "runworker" not in command:
            continue
        probe = deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]
        argv = probe["exec"]["command"]
        assert argv[1] == "platform/deploy/probes/worker_alive.py"
        assert (KUBERNETES.parent / "probes" / "worker_alive.py").exists()
        assert argv[argv.index("--deployment") + 1] == command[command.index("--deployment") + 1]
        assert float(argv[argv.index("--stale-after") + 1]) == HUNG_AFTER_S


def test_every_container_has_requests_and_a_memory_limit() -> None:
    for workload, template in pod_templates():
        for container in template["spec"]["containers"]:
            resources = container.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), workload["metadata"]
            assert "memory" in resources.get("limits", {}), workload["metadata"]


def test_pods_run_as_the_images_non_root_user_without_privileges() -> None:
    for workload, template in pod_templates():
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001  # the Containerfile's user
        assert pod["serviceAccountName"] == "sluice"
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, workload["metadata"]
            assert context["capabilities"]["drop"] == ["ALL"]
            assert context["readOnlyRootFilesystem"] is True
            assert container["image"] in ("sluice", "sluice-cuda")
    account = of_kind("ServiceAccount")[0]
    assert account["automountServiceAccountToken"] is False


def test_secrets_are_referenced_never_written() -> None:
    assert not of_kind("Secret"), "secrets come from the cluster's store, not from here"
    for _workload, template in pod_templates():
        for container in template["spec"]["containers"]:
            assert container["envFrom"] == [{"secretRef": {"name": "sluice-env"}}]
            for var in container.get("env", []):
                if SECRET_NAME.search(var["name"]) and "DIR" not in var["name"]:
                    assert "value" not in var and "secretKeyRef" in var["valueFrom"], var
        for volume in template["spec"].get("volumes", []):
            assert set(volume) & {"emptyDir", "secret", "persistentVolumeClaim"}, volume


def test_the_gateways_and_celery_share_one_state_dir() -> None:
    """Uploaded files and audit exports are written by one and read by the other."""
    (claim,) = of_kind("PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for name in ("sluice-gateway", "sluice-celery"):
        deployment = next(d for d in of_kind("Deployment") if d["metadata"]["name"] == name)
        pod = deployment["spec"]["template"]["spec"]
        volume = next(v["name"] for v in pod["volumes"]
                      if v.get("persistentVolumeClaim", {}).get("claimName")
                      == claim["metadata"]["name"])
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts[volume] == "/var/lib/sluice"  # the image's SLUICE_STATE_DIR
        assert pod["securityContext"]["fsGroup"] == 10001  # writable by the image's user


def test_every_replicated_workload_has_a_disruption_budget() -> None:
    budgets = of_kind("PodDisruptionBudget")
    for deployment in of_kind("Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets if matches(b["spec"]["selector"], labels)]
        singleton = deployment["spec"].get("strategy", {}).get("type") == "Recreate"
        assert singleton or len(covering) == 1, deployment["metadata"]["name"]


def test_network_policies_deny_by_default_and_open_only_the_servers() -> None:
    policies = of_kind("NetworkPolicy")
    deny = [p for p in policies if p["spec"]["podSelector"] == {}
            and "ingress" not in p["spec"] and "Ingress" in p["spec"]["policyTypes"]]
    assert deny, "a default-deny ingress policy"
    opened = {}
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            app = policy["spec"]["podSelector"]["matchLabels"]["app"]
            opened[app] = sorted(p["port"] for p in rule["ports"])
    served = {}
    for deployment in of_kind("Deployment"):
        ports = [p["containerPort"] for c in deployment["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])]
        if ports:
            served[deployment["spec"]["template"]["metadata"]["labels"]["app"]] = sorted(ports)
    assert opened == served


def test_services_select_a_deployment_and_name_its_ports() -> None:
    for service in of_kind("Service"):
        targets = [d for d in of_kind("Deployment")
                   if matches({"matchLabels": service["spec"]["selector"]},
                              d["spec"]["template"]["metadata"]["labels"])]
        assert len(targets) == 1, service["metadata"]["name"]
        names = {p["name"] for c in targets[0]["spec"]["template"]["spec"]["containers"]
                 for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names


def _container(name: str) -> dict[str, Any]:
    deployment = next(d for d in of_kind("Deployment") if d["metadata"]["name"] == name)
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_one_beat_clock_and_a_standby_autoscaler() -> None:
    beat = next(d for d in of_kind("Deployment") if d["metadata"]["name"] == "sluice-celery-beat")
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"]["type"] == "Recreate"
    assert "--beat" not in _container("sluice-celery")["command"]
    assert _container("sluice-autoscaler")["command"][-2:] == ["--driver", "none"]
