"""deploy/: the Kubernetes manifests render with ``kubectl kustomize`` and validate
against the Kubernetes schemas; the Grafana dashboard queries only metrics the router
really exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import kubernetes_validate
import pytest
import yaml

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.engine.model import DEFAULT_MODEL, EngineConfig
from prefixroute.engine.server import start_engine_server
from prefixroute.server import start_router
from prefixroute.server.settings import ServerSettings
from test_server_helpers import eventually

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
#: The Kubernetes versions the manifests must be valid for: an older supported one and the newest schemas.
K8S_VERSIONS = ("1.30.0", "1.37.0")
#: Kinds defined by CRDs (no schema in kubernetes-validate): checked field by field below.
CRD_KINDS = {"ServiceMonitor", "InferencePool", "HTTPRoute"}


def render(directory: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is required (Debian: kubernetes-client; .ci/run installs it)"
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return render(DEPLOY / "kubernetes")


def test_manifests_validate_against_kubernetes_schemas(rendered):
    kinds = sorted({d["kind"] for d in rendered})
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Role", "RoleBinding", "Service",
                     "ServiceAccount", "ServiceMonitor"]
    checked = 0
    for doc in rendered:
        assert doc["metadata"]["namespace"] == "llm"
        if doc["kind"] in CRD_KINDS:
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError
            checked += 1
    assert checked == 2 * (len(rendered) - 1)


def test_a_broken_manifest_is_caught():
    """The validator is not a rubber stamp."""
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"replicas": "two", "selector": {}, "template": {"spec": {"containers": []}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_router_deployment_is_production_shaped(rendered):
    docs = by_kind(rendered)
    dep = docs[("Deployment", "prefixroute")]
    assert dep["spec"]["replicas"] >= 2
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "prefixroute"
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    (c,) = pod["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # readiness follows the fleet; liveness only the process (a down fleet must not restart the routers)
    assert c["readinessProbe"]["httpGet"]["path"] == "/health" and c["livenessProbe"]["httpGet"]["path"] == "/metrics"
    assert {"cpu", "memory"} <= set(c["resources"]["requests"])
    assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}  # the only writable place
    args = c["args"]
    assert "--admin-host=127.0.0.1" in args and "--config=/etc/prefixroute/fleet.yaml" in args
    # the shutdown drain fits in the grace period
    drain = int(next(a for a in args if a.startswith("--shutdown-timeout=")).split("=")[1])
    assert pod["terminationGracePeriodSeconds"] > drain
    # the Service, the PDB and the ServiceMonitor select these pods
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert docs[("Service", "prefixroute")]["spec"]["selector"].items() <= labels.items()
    assert docs[("PodDisruptionBudget", "prefixroute")]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert docs[("PodDisruptionBudget", "prefixroute")]["spec"]["minAvailable"] == 1
    sm = docs[("ServiceMonitor", "prefixroute")]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["endpoints"][0] == {"port": "http", "path": "/metrics", "interval": "15s"}
    assert sm["spec"]["selector"]["matchLabels"].items() <= docs[("Service", "prefixroute")]["metadata"][
        "labels"].items()


def test_rbac_grants_only_endpointslice_reads(rendered):
    docs = by_kind(rendered)
    role = docs[("Role", "prefixroute-endpointslice-reader")]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = docs[("RoleBinding", "prefixroute-endpointslice-reader")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "prefixroute", "namespace": "llm"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


def test_fleet_configmap_is_a_valid_fleet_on_the_vllm_service(rendered):
    docs = by_kind(rendered)
    fleet = FleetConfig.from_yaml(docs[("ConfigMap", "prefixroute-fleet")]["data"]["fleet.yaml"])
    k8s = fleet.endpoints[0].variants[0].discovery.kubernetes
    svc = docs[("Service", "vllm")]
    assert k8s.service == "vllm" and k8s.port_name in {p["name"] for p in svc["spec"]["ports"]}
    vllm = docs[("Deployment", "vllm")]["spec"]["template"]["spec"]["containers"][0]
    assert "--enable-prefix-caching" in vllm["args"]
    assert vllm["readinessProbe"]["httpGet"]["path"] == "/health"


# -- the endpoint picker: InferencePool, picker Deployment, Envoy example -----------------


def test_gateway_manifests_render_validate_and_fit_together(rendered):
    docs = render(DEPLOY / "kubernetes" / "gateway")
    assert sorted(d["kind"] for d in docs) == ["Deployment", "HTTPRoute", "InferencePool", "PodDisruptionBudget",
                                               "Role", "RoleBinding", "Service", "ServiceAccount"]
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)
    g, base = by_kind(docs), by_kind(rendered)
    pool = g[("InferencePool", "vllm")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    vllm_pod = base[("Deployment", "vllm")]["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"] == vllm_pod["metadata"]["labels"]
    assert pool["spec"]["targetPorts"] == [{"number": vllm_pod["spec"]["containers"][0]["ports"][0]["containerPort"]}]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    svc = g[("Service", ref["name"])]
    grpc_port = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert grpc_port["appProtocol"] == "kubernetes.io/h2c"
    route = g[("HTTPRoute", "vllm")]
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "vllm"}]
    # the picker's own flags parse with the real command line, and agree with the pool
    from prefixroute.cli import build_parser
    from prefixroute.server.cli import build_config

    dep = g[("Deployment", "prefixroute-epp")]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(c["args"])
    assert args.port == ref["port"]["number"] and args.host == "0.0.0.0"
    fleet = build_config(args)
    k8s = fleet.endpoints[0].variants[0].discovery.kubernetes
    assert k8s.service == "vllm" and k8s.port_name in {p["name"] for p in base[("Service", "vllm")]["spec"]["ports"]}
    assert c["readinessProbe"]["grpc"] == {"port": args.port, "service": "readiness"}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    role = g[("Role", "prefixroute-epp-endpointslice-reader")]
    assert role["rules"][0]["verbs"] == ["get", "list", "watch"]


def test_envoy_example_is_what_the_picker_prints_and_envoy_accepts_it():
    from prefixroute.epp.envoy_process import envoy_binary

    example = (DEPLOY / "envoy" / "envoy.yaml").read_text()
    argv = [sys.executable, "-m", "prefixroute", "epp", "--backend", "http://10.0.0.11:8000", "--backend",
            "http://10.0.0.12:8000", "--backend", "http://10.0.0.13:8000", "--print-envoy-config", "8080"]
    printed = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    assert yaml.safe_load(example) == yaml.safe_load(printed)
    doc = yaml.safe_load(printed)
    ext_proc = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "http_filters"][1]["typed_config"]
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED" and ext_proc["allow_mode_override"] is True
    assert ext_proc["failure_mode_allow"] is False
    out = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(DEPLOY / "envoy" / "envoy.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "OK" in out.stdout + out.stderr, out.stderr[-500:]
    # the Inference Extension's body mode, on request
    duplex = yaml.safe_load(subprocess.run([*argv, "--envoy-body-mode", "full-duplex"], capture_output=True,
                                           text=True, timeout=60, check=True).stdout)
    mode = duplex["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "http_filters"][1]["typed_config"]["processing_mode"]
    assert (mode["request_body_mode"], mode["response_body_mode"], mode["request_trailer_mode"]) == \
        ("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED", "SEND")
    from prefixroute.epp.envoy_config import picker_bootstrap

    with pytest.raises(ValueError, match="body_mode must be one of buffered, full-duplex"):
        picker_bootstrap(8080, ("127.0.0.1", 9002), [("10.0.0.11", 8000)], body_mode="streamed")


# -- the Grafana dashboard -------------------------------------------------------------

#: PromQL words that are not metric names.
_PROMQL_WORDS = {"sum", "by", "rate", "increase", "histogram_quantile", "min", "max", "avg", "le", "without",
                 "on", "ignoring", "group_left", "group_right", "count", "topk", "bottomk", "irate", "label_values"}


def dashboard_metrics() -> set[str]:
    dash = json.loads((DEPLOY / "grafana" / "prefixroute-dashboard.json").read_text())
    names: set[str] = set()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    assert len(exprs) >= 12
    for expr in exprs:
        no_strings = re.sub(r'"[^"]*"', '""', re.sub(r"label_values\(([^,]+),[^)]*\)", r"\1", expr))
        no_labels = re.sub(r"\{[^}]*\}", "", no_strings)
        no_groups = re.sub(r"\b(by|without)\s*\([^)]*\)", "", no_labels)
        no_ranges = re.sub(r"\[[^\]]*\]", "", no_groups)
        for word in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", no_ranges):
            if word not in _PROMQL_WORDS and not re.fullmatch(r"[0-9.]+", word):
                names.add(word)
    return names


def exported_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "counter":
                names.add(name + "_total")
            elif kind == "histogram":
                names.update(name + s for s in ("_bucket", "_sum", "_count"))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


async def test_every_dashboard_metric_is_exported():
    used = dashboard_metrics()
    assert "prefixroute_fleet_prefix_cache_hit_rate" in used and "prefixroute_discovery_errors_total" in used
    runner, port = await start_engine_server(EngineConfig(), time_scale=0.0)
    url = f"http://127.0.0.1:{port}"
    config = FleetConfig.from_mapping({"Endpoints": [{"EndpointName": "default", "ProductionVariants": [{
        "VariantName": "AllTraffic", "Instances": [url], "RoutingConfig": RoutingConfig.build("prefix-aware", 1024, 8),
        # a discovery source that never answers: its families and error series exist
        "Discovery": {"DNS": {"Name": "nothing.invalid", "Port": 1, "TimeoutSeconds": 0.2,
                              "Nameservers": ["127.0.0.1:9"]}}}]}]})
    handle = await start_router(config, ServerSettings(port=0, admin_port=0, metrics_scrape_interval_s=0.2))
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(2):
                async with http.post(handle.url + "/v1/completions", json={
                        "model": DEFAULT_MODEL, "prompt": "x" * 2000, "max_tokens": 2}) as r:
                    assert r.status == 200
            assert await eventually(lambda: url in handle.state.backend_stats, 5)
            assert await eventually(lambda: handle.state.discovery.memberships[("default", "AllTraffic")].failures
                                    > 0, 5)
            text = await (await http.get(handle.url + "/metrics")).text()
    finally:
        await handle.close()
        await runner.cleanup()
    exported = exported_names(text)
    assert "prefixroute_discovery_errors_totl" not in exported and "prefixroute_ttft_seconds_bucket" in exported
    missing = sorted(used - exported)
    assert not missing, f"the dashboard queries metrics the router does not export: {missing}"
