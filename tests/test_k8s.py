"""deploy/k8s/: every manifest validated offline against the Kubernetes schema of a pinned version (strict: an
unknown field fails), and held to the container's real interface (entrypoint.sh, the settings, the Dockerfile's
start-up allowance, the metrics the server exports)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from server.config import OPTIONS, Settings
from tests.support.api_fixtures import live_server, settings

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.33.0"  # the schema the manifests are held to (EKS standard support at the time of writing)
IMAGE = "xbill9/gemma4-optb-26b:xlarge"
OPTIONAL = {"hpa-queue-depth.yaml"}  # needs a custom-metrics adapter: not in the kustomize base


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifests() -> dict[str, dict[str, Any]]:
    """kind -> the one resource of that kind (the base has one of each)."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in documents(path):
            assert doc["kind"] not in found, f"two {doc['kind']}s"
            found[doc["kind"]] = doc
    return found


def container() -> dict[str, Any]:
    (only,) = manifests()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


def env() -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container()["env"]}


@pytest.mark.parametrize("path", sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"))
def test_manifest_is_valid_against_the_pinned_schema(path: str) -> None:
    docs = documents(K8S / path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_rejects_a_wrong_field() -> None:
    broken = manifests()["Deployment"]
    broken["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["failureTreshold"] = 3  # a typo
    with pytest.raises(kubernetes_validate.ValidationError, match="failureTreshold"):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    (kustomization,) = documents(K8S / "kustomization.yaml")
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk - OPTIONAL


def test_deployment_runs_the_image_on_one_neuron_device() -> None:
    spec = container()
    assert spec["image"] == IMAGE and IMAGE in (ROOT / "README.md").read_text()
    assert spec["resources"]["limits"]["aws.amazon.com/neuron"] == 1
    assert "memory" not in spec["resources"]["limits"]  # Burstable: the graph load may use the node's swap


def test_env_is_the_containers_real_interface() -> None:
    entrypoint = (ROOT / "entrypoint.sh").read_text()
    header = entrypoint.split("set -euo pipefail")[0]
    interface = {name for group in re.findall(r"^#\s+([A-Z][A-Z0-9_]*(?:, [A-Z][A-Z0-9_]*)*)\s", header, re.M)
                 for name in group.split(", ")}
    parsers = {option.env: option.kind for option in OPTIONS if option.env}
    assert {"ARTIFACTS_DIR", "GRAPH", "HOST", "PORT", "HF_TOKEN"} <= interface  # the parse found the header
    for name, value in env().items():
        assert name in interface | set(parsers), f"{name} is read by neither entrypoint.sh nor the server"
        if value is not None and name in parsers:
            parsers[name](value)  # a value the server accepts at start-up
    mounts = {m["name"]: m["mountPath"] for m in container()["volumeMounts"]}
    assert env()["ARTIFACTS_DIR"] == mounts["artifacts"]
    (port,) = container()["ports"]
    assert env()["PORT"] == str(port["containerPort"]) and port["name"] == "http"


def test_probes_tolerate_the_load_and_grace_exceeds_the_drain() -> None:
    spec = container()
    startup, ready, live = spec["startupProbe"], spec["readinessProbe"], spec["livenessProbe"]
    for probe in (startup, ready, live):
        assert probe["httpGet"] == {"path": "/health", "port": "http"}
    # at least the image's own HEALTHCHECK start period (first download + graph load)
    start_period_min = int(re.search(r"--start-period=(\d+)m", (ROOT / "Dockerfile").read_text()).group(1))
    assert startup["periodSeconds"] * startup["failureThreshold"] >= start_period_min * 60

    pod = manifests()["Deployment"]["spec"]["template"]["spec"]
    pause = int(spec["lifecycle"]["preStop"]["exec"]["command"][-1])
    default_grace = Settings().shutdown_grace_s
    drain = float(env().get("SHUTDOWN_GRACE") or default_grace)
    assert pod["terminationGracePeriodSeconds"] > pause + drain
    # liveness never fires during a drain (503 "draining" for at most the grace period)
    assert live["periodSeconds"] * live["failureThreshold"] > pod["terminationGracePeriodSeconds"]


def test_service_pdb_pvc_and_hpa_point_at_the_deployment() -> None:
    found = manifests()
    deployment = found["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = found["Service"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert service["spec"]["sessionAffinity"] == "ClientIP"  # prefix reuse lives in each replica's KV cache
    assert found["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (volume,) = deployment["spec"]["template"]["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == found["PersistentVolumeClaim"]["metadata"]["name"]
    hpa = found["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == deployment["metadata"]["name"]


@pytest.fixture(scope="module")
def exposition() -> str:
    """What a live server's /metrics says (the real app and engine, the null graph)."""
    with live_server(settings()) as live:
        return httpx.get(f"{live.url}/metrics", timeout=10).text


def test_hpa_scales_on_a_metric_the_server_exports(exposition: str) -> None:
    (metric,) = manifests()["HorizontalPodAutoscaler"]["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert f"# TYPE {name} gauge" in exposition
    assert name in (ROOT / "docs" / "kubernetes.md").read_text()


# What a prefix-aware endpoint picker reads from each replica (docs/kubernetes.md, "Agents"): load and KV.
PICKER_GAUGES = ("gemma4_queue_depth", "gemma4_kv_slots_in_use", "gemma4_kv_slots_in_use_ratio",
                 "gemma4_kv_tokens_in_use", "gemma4_kv_tokens_capacity", "gemma4_kv_tokens_in_use_ratio",
                 "gemma4_kv_cached_prefixes", "gemma4_kv_cached_prefix_tokens")


def test_what_a_picker_reads_is_exported_and_documented(exposition: str) -> None:
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    for name in PICKER_GAUGES:
        assert f"# TYPE {name} gauge" in exposition and f"`{name}`" in doc, name
    for name in set(re.findall(r"`(gemma4_[a-z_]+)`", doc)):  # the doc names no metric the server lacks
        assert re.search(rf"^# TYPE {name.removesuffix('_total')} ", exposition, re.M), name  # counters: _total


def test_the_service_keeps_an_agents_turns_on_one_replica() -> None:
    spec = manifests()["Service"]["spec"]
    # ClientIP affinity for an hour, renewed by each connection: an agent pausing between turns comes back to its KV.
    assert spec["sessionAffinity"] == "ClientIP"
    timeout = spec["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"]
    assert timeout >= 3600 and f"{timeout:,} s" in (ROOT / "docs" / "kubernetes.md").read_text()
