"""deploy/kubernetes: the base (CPU engine nodes) and the GPU overlay render with `kubectl
kustomize`, every object validates against a current Kubernetes schema (kubernetes-validate,
strict: no field Kubernetes does not know), and the objects say what docs/deploy.md promises."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZATIONS = {
    "base": ROOT / "deploy" / "kubernetes" / "base",
    "gpu": ROOT / "deploy" / "kubernetes" / "overlays" / "gpu",
}

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its kustomize) is not installed")


def render(which: str) -> list[dict[str, Any]]:
    done = subprocess.run(["kubectl", "kustomize", str(KUSTOMIZATIONS[which])], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["spec"]
            for d in docs if d["kind"] in ("Deployment", "DaemonSet", "Job")}  # fmt: skip


@pytest.mark.parametrize("which", ["base", "gpu"])
def test_every_object_renders_and_validates_against_a_current_kubernetes(which):
    docs = render(which)
    version = kubernetes_validate.latest_version()
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:  # pragma: no cover (the message is the point)
            pytest.fail(f"{which}: {doc['kind']}/{doc['metadata']['name']} is not valid Kubernetes {version}: {exc}")
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"inference"}


@pytest.mark.parametrize("which", ["base", "gpu"])
def test_the_objects_the_platform_needs_are_there(which):
    docs = render(which)
    gateway = one(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert one(docs, "PodDisruptionBudget", "gateway")["spec"]["minAvailable"] >= 1
    (metric,) = one(docs, "HorizontalPodAutoscaler", "gateway")["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "inference_in_flight"  # one the gateways export
    queues = {d["metadata"]["labels"].get("inference-platform/queue") for d in docs if d["kind"] == "Deployment"}
    assert {"metering", "control", "slow", "batch", "beat"} <= queues
    beat = one(docs, "Deployment", "celery-beat")
    assert (beat["spec"]["replicas"], beat["spec"]["strategy"]["type"]) == (1, "Recreate")
    assert one(docs, "Job", "migrate")["spec"]["template"]["spec"]["containers"][0]["command"][-2:] == [
        "migrate", "--noinput"
    ]  # fmt: skip
    assert {"SECRET_KEY", "DATABASE_URL", "REDIS_URL"} <= set(one(docs, "Secret", "platform-secrets")["stringData"])
    policy = one(docs, "NetworkPolicy", "engines-from-gateways-only")["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "engines"
    assert policy["policyTypes"] == ["Ingress"]
    allowed = {
        source["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for rule in policy["ingress"]
        for source in rule["from"]
        if "podSelector" in source
    }
    assert allowed == {"gateway", "celery"}  # the batch workers call engines too
    # Every container runs as the image's non-root user, with nothing to escalate to.
    for where, spec in pod_specs(docs).items():
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        for container in spec["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, where
            assert container["image"].startswith("registry.example.com/inference-platform:"), where


def test_the_gpu_overlay_places_one_supervisor_per_gpu_node_with_its_gpus():
    engines = one(render("gpu"), "DaemonSet", "engines")["spec"]["template"]["spec"]
    container = engines["containers"][0]
    assert container["command"] == ["python", "manage.py", "runworkers"]
    assert engines["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
    env = {e["name"]: e for e in container["env"]}
    assert env["WORKER_DEVICE"]["value"] == "gpu"
    assert "WORKER_SLOTS" not in env  # taken from the GPUs the pod is given
    assert env["WORKER_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"  # one lease per node
    assert env["WORKER_ENGINE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert container["image"].endswith(":gpu")
    cpu = one(render("base"), "DaemonSet", "engines")["spec"]["template"]["spec"]
    assert cpu["nodeSelector"] == {"inference-platform/engines": "true"}


@pytest.mark.parametrize(
    ("given", "slots"),
    [
        ({"WORKER_DEVICE": "gpu", "NVIDIA_VISIBLE_DEVICES": "GPU-1a,GPU-2b,GPU-3c"}, ["0", "1", "2"]),
        ({"WORKER_DEVICE": "gpu", "CUDA_VISIBLE_DEVICES": "4,5", "NVIDIA_VISIBLE_DEVICES": "all"}, ["0", "1"]),
        ({"WORKER_DEVICE": "gpu", "WORKER_SLOTS": "3"}, ["3"]),
    ],
)
def test_a_gpu_hosts_slots_are_the_gpus_it_was_given(given, slots):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORKER_SLOTS", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
    }
    code = "from django.conf import settings; print(','.join(settings.WORKER_SLOTS))"
    env |= {**given, "DJANGO_SETTINGS_MODULE": "console.settings"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().split(",") == slots
