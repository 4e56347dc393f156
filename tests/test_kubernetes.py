"""deploy/kubernetes/ validates offline (the core kinds against Kubernetes' own schemas, the
custom kinds against their CRDs') and keeps the promises docs/kubernetes.md makes: probes, grace
periods, non-root and read-only, sized resources, a trigger per lane on its unfinished photos
that no pause holds, the alerts promtool tests; and what KEDA reads from PostgreSQL means
what the triggers assume, checked against the real database."""

from __future__ import annotations

import copy
import functools
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import jsonschema
import kubernetes_validate
import pytest
import yaml

from darkroom.config.env import from_env
from darkroom.errors import SettingsError
from darkroom.queue import lanes
from darkroom.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
# The oldest minor the manifests claim to run on, and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.latest_version())
CUSTOM_KINDS = {"ScaledObject", "PodMonitor", "PrometheusRule"}
IMAGE_UID = 10001  # the Dockerfile's USER
# After the shutdown grace, the exit's own bounds (docs/reliability.md, shutdown): the shielded
# failure record 20 s, leaving the group 2 s, three connections closed 5 s each.
EXIT_BOUNDS_S = 20 + 2 + 3 * 5 + 5 + 6 + 3


@functools.cache
def manifests() -> tuple[dict[str, Any], ...]:
    """Every object of every file the kustomization lists, in order (shared: do not mutate)."""
    listed = yaml.safe_load((KUBE / "kustomization.yaml").read_text())["resources"]
    return tuple(doc for name in listed for doc in yaml.safe_load_all((KUBE / name).read_text()))


def one(kind: str, name: str) -> dict[str, Any]:
    [found] = [m for m in manifests() if m["kind"] == kind and m["metadata"]["name"] == name]
    return found


def pod_specs() -> Iterator[dict[str, Any]]:
    for manifest in manifests():
        if manifest["kind"] in ("Deployment", "Job"):
            yield manifest["spec"]["template"]["spec"]


def worker_container() -> dict[str, Any]:
    [container] = one("Deployment", "darkroom-worker")["spec"]["template"]["spec"]["containers"]
    return dict(container)


def worker_env() -> dict[str, str]:
    """What a worker pod's environment holds, less the Secret's keys."""
    literal = {e["name"]: e["value"] for e in worker_container()["env"] if "value" in e}
    return {**one("ConfigMap", "darkroom")["data"], **literal}


def worker_settings() -> Settings:
    return from_env(worker_env())


def triggers() -> list[dict[str, Any]]:
    return list(one("ScaledObject", "darkroom-worker")["spec"]["triggers"])


def test_the_kustomization_lists_every_manifest() -> None:
    """No manifest in deploy/kubernetes/ is left out of `kubectl apply -k`."""
    listed = set(yaml.safe_load((KUBE / "kustomization.yaml").read_text())["resources"])
    present = {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


def test_every_core_manifest_validates_against_the_kubernetes_schemas() -> None:
    """Every core object passes Kubernetes' strict schemas: a misspelt field fails."""
    core = [m for m in manifests() if m["kind"] not in CUSTOM_KINDS]
    assert {m["kind"] for m in core} >= {"Deployment", "PodDisruptionBudget", "ConfigMap", "Job"}
    for manifest in core:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(manifest, version, strict=True)


def crd_validator(kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((KUBE / "schemas" / f"{kind.lower()}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_every_custom_object_validates_against_its_crds_schema() -> None:
    """The ScaledObject, PodMonitor and PrometheusRule pass schemas made from their CRDs."""
    custom = [m for m in manifests() if m["kind"] in CUSTOM_KINDS]
    assert sorted(m["kind"] for m in custom) == sorted(CUSTOM_KINDS)
    for manifest in custom:
        crd_validator(manifest["kind"]).validate(manifest)


@pytest.mark.parametrize(
    ("kind", "name", "path", "bad"),
    [("ScaledObject", "darkroom-worker", ("spec", "pollingIntervall"), 15),
     ("ScaledObject", "darkroom-worker", ("spec", "minReplicaCount"), "0"),
     ("ScaledObject", "darkroom-worker", ("spec", "triggers", 0, "metadta"), {}),
     ("PodMonitor", "darkroom", ("spec", "podMetricsEndpoints", 0, "paht"), "/metrics"),
     ("PrometheusRule", "darkroom", ("spec", "groups", 0, "rules", 0, "expresion"), "up")],
)  # fmt: skip
def test_the_crd_schemas_refuse_a_misspelt_field_or_a_wrong_type(
    kind: str, name: str, path: tuple[Any, ...], bad: Any
) -> None:
    """A typo or a quoted number in a custom object fails the test, not the cluster."""
    manifest = copy.deepcopy(one(kind, name))
    node = manifest
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises(jsonschema.ValidationError):
        crd_validator(kind).validate(manifest)


def test_the_manifests_settings_are_ones_darkroom_accepts() -> None:
    """darkroom accepts every container's settings, and concurrency equals the CPU limit."""
    config = one("ConfigMap", "darkroom")["data"]
    for spec in pod_specs():
        for container in spec["containers"]:
            literal = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
            from_env({**config, **literal})
    settings = worker_settings()
    assert settings.concurrency == int(worker_container()["resources"]["limits"]["cpu"])
    assert settings.metrics_port == worker_container()["ports"][0]["containerPort"]


def test_the_worker_probes_livez_and_readyz_on_the_metrics_port() -> None:
    """Liveness and start-up ask /livez, readiness /readyz, on the port the worker serves."""
    container = worker_container()
    [port] = container["ports"]
    assert port["containerPort"] == worker_settings().metrics_port
    paths = {probe: container[probe]["httpGet"]["path"] for probe in
             ("startupProbe", "livenessProbe", "readinessProbe")}  # fmt: skip
    assert paths == {
        "startupProbe": "/livez",
        "livenessProbe": "/livez",
        "readinessProbe": "/readyz",
    }
    assert {container[p]["httpGet"]["port"] for p in paths} == {port["name"]}


def test_the_termination_grace_outlasts_the_shutdown_grace_and_the_exit() -> None:
    """Kubernetes sends SIGKILL only after a worker could have drained and exited."""
    spec = one("Deployment", "darkroom-worker")["spec"]["template"]["spec"]
    grace_s = worker_settings().shutdown_grace_s
    assert spec["terminationGracePeriodSeconds"] > grace_s + EXIT_BOUNDS_S


def test_every_pod_runs_non_root_on_a_read_only_root_with_tmp_writable() -> None:
    """Pods run as the image's uid on a read-only root; the worker's /tmp is an emptyDir."""
    for spec in pod_specs():
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == IMAGE_UID
        for container in spec["containers"]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
    worker = one("Deployment", "darkroom-worker")["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in worker_container()["volumeMounts"]}
    assert "emptyDir" in {v["name"]: v for v in worker["volumes"]}[mounts["/tmp"]]


def test_no_pod_gets_service_variables_darkroom_would_refuse() -> None:
    """Service links are off: the Service darkroom-web would add unknown DARKROOM_* names."""
    for service in (m["metadata"]["name"] for m in manifests() if m["kind"] == "Service"):
        linked = {f"{service.upper().replace('-', '_')}_SERVICE_HOST": "10.0.0.1"}
        with pytest.raises(SettingsError, match="unknown setting"):
            from_env({**worker_env(), **linked})
    for spec in pod_specs():
        assert spec["enableServiceLinks"] is False


def test_every_container_has_cpu_and_memory_requests_and_limits() -> None:
    """No container is unbounded or unscheduled; a limit is never below its request."""
    for spec in pod_specs():
        for container in spec["containers"]:
            resources = container["resources"]
            for kind in ("cpu", "memory"):
                assert quantity(resources["requests"][kind]) <= quantity(resources["limits"][kind])


def quantity(text: str) -> float:
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "": 1}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text).groups()  # type: ignore[union-attr]
    return float(number) * units[unit]


def test_the_disruption_budget_selects_the_worker_pods() -> None:
    """The PDB's selector matches the worker pods' labels and lets one go at a time."""
    pdb = one("PodDisruptionBudget", "darkroom-worker")["spec"]
    labels = one("Deployment", "darkroom-worker")["spec"]["template"]["metadata"]["labels"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["maxUnavailable"] == 1


def test_the_scaled_object_scales_the_worker_deployment_to_zero() -> None:
    """KEDA drives the worker Deployment, which has no replicas of its own to fight it."""
    spec = one("ScaledObject", "darkroom-worker")["spec"]
    assert spec["scaleTargetRef"]["name"] == "darkroom-worker"
    assert spec["scaleTargetRef"]["envSourceContainerName"] == worker_container()["name"]
    assert spec["minReplicaCount"] == 0
    assert "replicas" not in one("Deployment", "darkroom-worker")["spec"]


def test_each_lane_has_a_postgresql_trigger_on_the_workers_database_with_a_cap() -> None:
    """One PostgreSQL trigger per lane, on the workers' database; its cap never hides demand."""
    spec = one("ScaledObject", "darkroom-worker")["spec"]
    assert [(t["type"], t["name"]) for t in triggers()] == [
        ("postgresql", lane) for lane in lanes.LANES]  # fmt: skip
    for trigger in [t["metadata"] for t in triggers()]:
        assert trigger["connectionFromEnv"] == "DARKROOM_DATABASE_URL"
        cap = int(re.search(r"LIMIT (\d+)", trigger["query"]).group(1))  # type: ignore[union-attr]
        assert cap >= spec["maxReplicaCount"] * int(trigger["targetQueryValue"])


def lane_query(lane: str) -> str:
    [trigger] = [t["metadata"] for t in triggers() if t["name"] == lane]
    return str(trigger["query"])


PAUSE_SQL = """
INSERT INTO queue_pauses (lane, tenant, operator, reason, until)
VALUES ($1, $2, 'op', 'test', now() + make_interval(secs => $3))
"""


async def test_each_lane_s_query_counts_its_unfinished_photos_no_pause_holds(
    database_url: str,
) -> None:
    """Each lane's query counts that lane's unfinished photos, 0 once they end, and leaves
    out those of a paused lane or tenant while the pause is in force (a paused backlog asks
    for no pod); an expired pause holds nothing."""
    conn = await asyncpg.connect(database_url)
    insert = "INSERT INTO photos (id, original_key, lane, tenant) VALUES ($1, 'k', $2, $3)"
    try:
        ids = {(lane, tenant): uuid.uuid4() for lane in lanes.LANES for tenant in ("a", "b")}
        for (lane, tenant), photo_id in ids.items():
            await conn.execute(insert, photo_id, lane, tenant)
        await conn.execute("UPDATE photos SET processing_state = 'processing' WHERE tenant = 'a'")

        async def counts() -> tuple[int, ...]:
            return tuple([await conn.fetchval(lane_query(lane)) for lane in lanes.LANES])

        assert await counts() == (2, 2)
        await conn.execute(PAUSE_SQL, "bulk", None, None)
        assert await counts() == (2, 0), "a paused lane's backlog counted"
        await conn.execute(PAUSE_SQL, None, "a", None)
        assert await counts() == (1, 0), "a paused tenant's photos counted"
        await conn.execute("DELETE FROM queue_pauses WHERE tenant IS NULL")
        await conn.execute(PAUSE_SQL, None, None, -1.0)  # a timed pause that ran out
        assert await counts() == (1, 1)
        await conn.execute("DELETE FROM queue_pauses")
        await conn.execute("UPDATE photos SET processing_state = 'processing_failed'")
        assert await counts() == (0, 0)
    finally:
        await conn.close()


def test_the_prometheus_rule_holds_the_rules_promtool_tests() -> None:
    """The PrometheusRule is alerts.yaml rule for rule (regenerate: scripts/prometheus-rule)."""
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())
    rule = one("PrometheusRule", "darkroom")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == alerts["groups"]


def test_prometheus_scrapes_the_workers_and_the_web_metrics_ports() -> None:
    """The PodMonitor selects darkroom's pods and scrapes the ports their /metrics are on."""
    monitor = one("PodMonitor", "darkroom")["spec"]
    ports = {e["port"] for e in monitor["podMetricsEndpoints"]}
    web = one("Deployment", "darkroom-web")["spec"]["template"]["spec"]["containers"][0]
    assert ports == {worker_container()["ports"][0]["name"], web["ports"][0]["name"]}
    for deployment in ("darkroom-worker", "darkroom-web"):
        labels = one("Deployment", deployment)["spec"]["template"]["metadata"]["labels"]
        assert monitor["selector"]["matchLabels"].items() <= labels.items()
