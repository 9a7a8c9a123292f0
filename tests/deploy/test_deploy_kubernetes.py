"""Checks for deploy/kubernetes/: every manifest validates against the Kubernetes schemas
(kubernetes-validate ships them, so this works offline), and the pieces agree with each
other and with the server: probes, drain timing, selectors, ports, and the autoscaler's
metric name vs the prometheus-adapter rule.

That the metric's underlying series really appears in a live /metrics scrape is checked in
tests/deploy/test_deploy_metrics_live.py.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import utils as kv

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
BASE = K8S / "base"
ADAPTER = K8S / "prometheus-adapter"

# The oldest and newest Kubernetes the package has schemas for: the manifests must be valid
# for both (1.25 is older than any cluster still supported upstream).
VERSIONS = (kv.all_versions()[0], kv.latest_version())
# Files that are not plain Kubernetes objects.
NOT_OBJECTS = {"kustomization.yaml", "helm-values.yaml"}


OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
COMPONENTS = sorted(p.parent for p in (K8S / "components").glob("*/kustomization.yaml"))


def patch_files() -> set[Path]:
    """Files kustomizations use as patches: partial objects, checked in the rendered output."""
    found = set()
    for kustomization in K8S.rglob("kustomization.yaml"):
        for patch in yaml.safe_load(kustomization.read_text()).get("patches", []):
            if "path" in patch:
                found.add((kustomization.parent / patch["path"]).resolve())
    return found


def manifest_files() -> list[Path]:
    patches = patch_files()
    return sorted(p for p in K8S.rglob("*.yaml") if p.name not in NOT_OBJECTS and p.resolve() not in patches)


def load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def objects(directory: Path) -> dict[tuple[str, str], dict]:
    """(kind, name) -> object for the resources a kustomization lists."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    found = {}
    for rel in kustomization["resources"]:
        for doc in load_all(directory / rel):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def validate(doc: dict, version: str) -> None:
    try:
        kv.validate(doc, version, strict=True)  # strict: unknown fields (typos) are errors too
    except kv.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for {version}: {path}: {exc.message}")
    # SchemaNotFoundError propagates: an unknown kind/apiVersion is a failure, not a skip.


# --- schema validation --------------------------------------------------------------------

def test_there_are_manifests():
    kinds = {doc["kind"] for path in manifest_files() for doc in load_all(path)}
    assert {"Deployment", "Service", "Ingress", "PodDisruptionBudget", "ConfigMap",
            "HorizontalPodAutoscaler"} <= kinds


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates(path, version):
    docs = load_all(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        validate(doc, version)


def test_validator_rejects_a_broken_manifest():
    # The schema check must be able to fail: a typo'd field and a wrong type.
    deployment = objects(BASE)[("Deployment", "streamvox")]
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 40
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, VERSIONS[-1], strict=True)
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, VERSIONS[-1], strict=True)


@pytest.mark.parametrize("directory", [BASE, ADAPTER, *OVERLAYS, *COMPONENTS], ids=lambda p: p.name)
def test_kustomization_references_exist(directory):
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert kustomization["kind"] == ("Component" if directory in COMPONENTS else "Kustomization")
    for rel in kustomization.get("resources", []):
        assert (directory / rel).exists(), f"{directory.name}: missing resource {rel}"
    for rel in kustomization.get("components", []):
        assert (directory / rel / "kustomization.yaml").is_file(), f"{directory.name}: missing component {rel}"
    for patch in kustomization.get("patches", []):
        if "path" in patch:
            assert (directory / patch["path"]).is_file()
    listed = {(directory / r).resolve() for r in kustomization.get("resources", [])}
    # A manifest file in base/ that the kustomization forgets would silently never be applied.
    if directory in (BASE, ADAPTER):
        on_disk = {p.resolve() for p in directory.glob("*.yaml") if p.name not in NOT_OBJECTS}
        assert on_disk == listed


# --- rendering with kustomize (kubectl's built-in), where kubectl is installed ---------------

def kustomize(directory: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl not installed: the kustomize rendering is not checked")
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.parametrize("directory", [BASE, ADAPTER, *OVERLAYS], ids=lambda p: p.name)
def test_kustomize_output_validates(directory):
    rendered = kustomize(directory)
    assert rendered
    for doc in rendered:
        validate(doc, VERSIONS[-1])


def test_cpu_overlay_drops_the_gpu():
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in kustomize(K8S / "overlays" / "cpu")}
    pod = rendered[("Deployment", "streamvox")]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert not pod.get("tolerations")
    assert container["image"].endswith("-cpu")
    config = rendered[("ConfigMap", "streamvox-config")]["data"]
    assert config["STREAMVOX_DEVICE"] == "cpu" and config["STREAMVOX_PRESET"] == "small"
    # Everything else from base is still there.
    assert {k for k, _ in rendered} >= {"Service", "Ingress", "PodDisruptionBudget", "HorizontalPodAutoscaler"}


def test_durable_jobs_overlay_keeps_one_volume():
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in kustomize(K8S / "overlays" / "durable-jobs")}
    deployment = rendered[("Deployment", "streamvox")]["spec"]
    volumes = {v["name"]: v for v in deployment["template"]["spec"]["volumes"]}
    assert volumes["data"] == {"name": "data", "persistentVolumeClaim": {"claimName": "streamvox-data"}}
    assert ("PersistentVolumeClaim", "streamvox-data") in rendered
    # One pod at a time on a ReadWriteOnce volume: a fixed single replica, no autoscaler,
    # and the old pod gone before the new one mounts the volume.
    assert deployment["replicas"] == 1
    assert deployment["strategy"] == {"type": "Recreate"}
    assert not any(kind == "HorizontalPodAutoscaler" for kind, _ in rendered)


@pytest.mark.parametrize("overlay", ["postgres", "cpu-postgres"])
def test_postgres_overlays_share_one_database_and_keep_autoscaling(overlay):
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in kustomize(K8S / "overlays" / overlay)}
    database = rendered[("StatefulSet", "streamvox-postgres")]["spec"]
    pod = database["template"]["spec"]
    [postgres] = pod["containers"]
    assert postgres["image"].startswith("postgres:15")
    for probe in ("readinessProbe", "livenessProbe"):
        assert postgres[probe]["exec"]["command"][0] == "pg_isready"
    assert postgres["resources"]["requests"] and postgres["resources"]["limits"]["memory"]
    [claim] = database["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"]
    assert {m["name"]: m["mountPath"] for m in postgres["volumeMounts"]}[claim["metadata"]["name"]] == \
        "/var/lib/postgresql/data"
    service = rendered[("Service", database["serviceName"])]
    assert service["spec"]["selector"].items() <= database["template"]["metadata"]["labels"].items()
    # streamvox reads the URL and the password from the Secret this overlay makes, and the URL
    # names the database's Service and the user and database the image creates.
    secret = rendered[("Secret", "streamvox-jobs-db")]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    server = rendered[("Deployment", "streamvox")]["spec"]["template"]["spec"]["containers"][0]
    server_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in server["env"] if "valueFrom" in e}
    assert server_env["STREAMVOX_JOBS_DB"]["name"] == server_env["PGPASSWORD"]["name"] == "streamvox-jobs-db"
    assert env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "streamvox-jobs-db", "key": "password"}
    url = base64.b64decode(secret["data"][server_env["STREAMVOX_JOBS_DB"]["key"]]).decode()
    user, db = env["POSTGRES_USER"]["value"], env["POSTGRES_DB"]["value"]
    assert url == f"postgresql://{user}@{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/{db}"
    assert server_env["PGPASSWORD"]["key"] in secret["data"]
    # shared jobs keep the autoscaler, and no affinity is needed to find a job's replica
    assert ("HorizontalPodAutoscaler", "streamvox") in rendered
    assert "replicas" not in rendered[("Deployment", "streamvox")]["spec"]
    annotations = rendered[("Ingress", "streamvox")]["metadata"]["annotations"]
    assert not any("affinity" in key or "session-cookie" in key for key in annotations)
    limits = server["resources"].get("limits", {})
    assert ("nvidia.com/gpu" in limits) == (overlay == "postgres")  # the CPU variant keeps the CPU overlay's pods


def test_base_reads_the_job_database_from_an_optional_secret(base):
    env = {e["name"]: e for e in server_container(base)["env"]}
    for name, key in (("STREAMVOX_JOBS_DB", "url"), ("PGPASSWORD", "password")):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        # optional: without the Secret the server runs on its embedded per-pod store
        assert (ref["name"], ref["key"], ref["optional"]) == ("streamvox-jobs-db", key, True)


# --- the pieces agree ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def base() -> dict[tuple[str, str], dict]:
    return objects(BASE)


def server_container(base) -> dict:
    containers = base[("Deployment", "streamvox")]["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "streamvox")


def config(base) -> dict[str, str]:
    return base[("ConfigMap", "streamvox-config")]["data"]


def test_gpu_deployment(base):
    container = server_container(base)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert config(base)["STREAMVOX_DEVICE"] == "cuda"
    assert container["args"] == ["serve"]
    assert {"configMapRef": {"name": "streamvox-config"}} in container["envFrom"]


def test_probes_point_at_the_right_endpoints(base):
    container = server_container(base)
    # jobs=optional: a job-database outage must not pull streaming out of the Service; the
    # server's answer to exactly this path is checked in tests/service/jobs/test_jobs_db_outage.py.
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz?jobs=optional"
    # Liveness must not use /readyz: warm-up and drain would get the container killed.
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["startupProbe"]["httpGet"]["path"] in ("/healthz", "/readyz")
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        port = container[probe]["httpGet"]["port"]
        assert port in port_names or port in port_names.values()


def test_server_listens_where_the_pod_says(base):
    data = config(base)
    container = server_container(base)
    assert data["STREAMVOX_HOST"] == "0.0.0.0"
    assert int(data["STREAMVOX_PORT"]) == container["ports"][0]["containerPort"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["data"] == data["STREAMVOX_DATA_DIR"]


def test_grace_period_covers_prestop_and_drain(base):
    pod = base[("Deployment", "streamvox")]["spec"]["template"]["spec"]
    container = server_container(base)
    drain = float(config(base)["STREAMVOX_DRAIN_SECONDS"])
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    # SIGTERM arrives only after preStop; the drain then runs; then the process needs to exit.
    margin = 5
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + margin


def test_data_dir_is_a_per_pod_claim(base):
    volumes = {v["name"]: v for v in base[("Deployment", "streamvox")]["spec"]["template"]["spec"]["volumes"]}
    template = volumes["data"]["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert template["accessModes"] == ["ReadWriteOnce"]
    assert template["resources"]["requests"]["storage"]


def test_selectors_match_the_pods(base):
    deployment = base[("Deployment", "streamvox")]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selectors = [
        deployment["spec"]["selector"]["matchLabels"],
        base[("Service", "streamvox")]["spec"]["selector"],
        base[("PodDisruptionBudget", "streamvox")]["spec"]["selector"]["matchLabels"],
    ]
    for selector in selectors:
        assert selector.items() <= pod_labels.items()


def test_service_and_ingress_route_to_the_server(base):
    service = base[("Service", "streamvox")]
    container = server_container(base)
    port_names = {p["name"] for p in container["ports"]}
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    for port in service_ports.values():
        assert port["targetPort"] in port_names
    ingress = base[("Ingress", "streamvox")]
    for rule in ingress["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            assert backend["name"] == service["metadata"]["name"]
            assert backend["port"].get("name") in service_ports or backend["port"].get("number") in {
                p["port"] for p in service_ports.values()}


def test_ingress_keeps_long_streams_open(base):
    annotations = base[("Ingress", "streamvox")]["metadata"]["annotations"]
    # ingress-nginx closes a proxied connection after 60 s without traffic by default.
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-send-timeout"]) >= 600
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"


def test_pod_is_scraped_by_prometheus(base):
    pod = base[("Deployment", "streamvox")]["spec"]["template"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == int(config(base)["STREAMVOX_PORT"])


# --- autoscaler <-> prometheus-adapter ------------------------------------------------------

def adapter_rules() -> list[dict]:
    configmap = objects(ADAPTER)[("ConfigMap", "streamvox-prometheus-adapter-rules")]
    return yaml.safe_load(configmap["data"]["config.yaml"])["rules"]


def series_name(rule: dict) -> str:
    match = re.match(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"])
    assert match, rule["seriesQuery"]
    return match.group(1)


def exposed_name(rule: dict) -> str:
    """The custom-metric name the adapter serves: name.matches applied to the series, rewritten by name.as."""
    series = series_name(rule)
    name = rule.get("name", {})
    pattern = name.get("matches", "^(.*)$")
    template = name.get("as", "${1}" if "(" in pattern else "${0}")
    match = re.search(pattern, series)
    assert match, f"name.matches {pattern!r} does not match {series!r}: the adapter would expose nothing"
    # The adapter uses Go's Regexp.Expand: $1 / ${1} refer to capture groups.
    return re.sub(r"\$\{?(\d+)\}?", lambda m: match.group(int(m.group(1))), template)


def hpa_metric_names(base) -> list[str]:
    hpa = base[("HorizontalPodAutoscaler", "streamvox")]
    return [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]


def hpa_series(base) -> list[str]:
    """The scraped series behind each HPA metric (used by the live /metrics test)."""
    by_exposed = {exposed_name(rule): series_name(rule) for rule in adapter_rules()}
    return [by_exposed[name] for name in hpa_metric_names(base)]


def test_hpa_scales_the_deployment_on_queue_depth(base):
    hpa = base[("HorizontalPodAutoscaler", "streamvox")]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "streamvox")
    assert hpa_metric_names(base) == ["streamvox_queue_depth"]
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    # The Deployment must leave replicas to the HPA, or every `kubectl apply` resets them.
    assert "replicas" not in base[("Deployment", "streamvox")]["spec"]


def test_hpa_metric_is_what_the_adapter_exposes(base):
    exposed = {exposed_name(rule) for rule in adapter_rules()}
    for name in hpa_metric_names(base):
        assert name in exposed, f"HPA asks for {name!r}, the adapter exposes {sorted(exposed)}"
    assert hpa_series(base) == ["streamvox_queue_depth"]


def test_adapter_rule_maps_to_pods():
    for rule in adapter_rules():
        overrides = rule["resources"]["overrides"]
        assert overrides["pod"]["resource"] == "pod" and overrides["namespace"]["resource"] == "namespace"
        # Go template placeholders the adapter fills in; without them the query ignores the HPA's pods.
        for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert placeholder in rule["metricsQuery"]


def test_exposed_name_logic_catches_a_mismatch():
    rule = {"seriesQuery": 'streamvox_queue_depth{pod!=""}', "name": {"matches": "^streamvox_(.*)$", "as": "${1}"}}
    assert exposed_name(rule) == "queue_depth"  # which an HPA asking for streamvox_queue_depth would miss


def test_helm_values_carry_the_same_rule():
    values = yaml.safe_load((ADAPTER / "helm-values.yaml").read_text())
    assert values["rules"]["custom"] == adapter_rules()


# --- the model: one shared Hugging Face cache, filled once ------------------------------------

def env_values(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_replicas_share_one_model_cache_filled_by_an_init_container(base):
    from engines.checkpoints.hub import parse_model_id

    pod = base[("Deployment", "streamvox")]["spec"]["template"]["spec"]
    server = server_container(base)
    [init] = pod["initContainers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    # one claim for all replicas, which mount it from any node at once
    claim = volumes["models"]["persistentVolumeClaim"]["claimName"]
    pvc = base[("PersistentVolumeClaim", claim)]["spec"]
    assert "ReadWriteMany" in pvc["accessModes"] and pvc["resources"]["requests"]["storage"]
    # the cache is mounted where HF_HOME says, in both containers
    hf_home = env_values(server)["HF_HOME"]
    assert env_values(init)["HF_HOME"] == hf_home
    for container, read_only in ((init, False), (server, True)):
        [mount] = [m for m in container["volumeMounts"] if m["name"] == "models"]
        assert mount["mountPath"] == hf_home and bool(mount.get("readOnly")) == read_only
    # the init container fetches the configured model with the same image and configuration
    assert init["args"] == ["download"] and init["image"] == server["image"]
    assert init["envFrom"] == server["envFrom"]
    assert parse_model_id(config(base)["STREAMVOX_MODEL"]) is not None
    token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")["valueFrom"]["secretKeyRef"]
    assert token["optional"] is True  # public models need no Secret
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    # the server never asks the hub at start: the model is in the cache by then
    assert env_values(server)["HF_HUB_OFFLINE"] == "1"


def test_model_in_image_overlay_serves_the_baked_model_without_the_shared_cache():
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in kustomize(K8S / "overlays" / "model-in-image")}
    pod = rendered[("Deployment", "streamvox")]["spec"]["template"]["spec"]
    server = pod["containers"][0]
    assert not pod.get("initContainers")
    assert "models" not in {v["name"] for v in pod["volumes"]}
    assert "/models" not in {m["mountPath"] for m in server["volumeMounts"]}
    assert not any(kind == "PersistentVolumeClaim" for kind, _ in rendered)
    # the image's own HF_HOME and STREAMVOX_MODEL (its build argument) apply, offline
    env = env_values(server)
    assert "HF_HOME" not in env and env["HF_HUB_OFFLINE"] == "1"
    assert "STREAMVOX_MODEL" not in rendered[("ConfigMap", "streamvox-config")]["data"]
    # everything else from the base is still there
    assert {k for k, _ in rendered} >= {"Service", "Ingress", "PodDisruptionBudget", "HorizontalPodAutoscaler"}
