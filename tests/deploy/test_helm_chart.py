"""The Helm chart: lints, renders manifests Kubernetes accepts, and wires a pipeline that works
(stage per pod, rendezvous on stage 0, scheduler listing every stage, only the router exposed,
the Redis password only from a Secret, GPUs requested when asked for)."""

from __future__ import annotations

import base64
import copy

import kubernetes_validate
import pytest
from kubernetes_validate.utils import SchemaNotFoundError

from tests.deploy.utils import (
    CHART,
    KUBERNETES_VERSIONS,
    container_argv,
    containers,
    find,
    flags,
    helm,
    labels,
    one,
    pod_spec,
    render,
    worker_argv,
)

GPU_VALUES = str(CHART / "values-gpu-4stage.yaml")
CONVEYOR_CONTAINERS = {"worker", "scheduler", "router", "model-fetch"}

# Value sets every structural test runs against: (id, helm args, pipeline stages).
VALUE_SETS = [
    ("default", [], 2),
    ("gpu-4stage", ["-f", GPU_VALUES], 4),
    (
        "metrics-existing-claim",
        [
            "--set",
            "metrics.enabled=true",
            "--set",
            "model.existingClaim=models",
            "--set",
            "router.autoscaling.enabled=false",
        ],
        2,
    ),
    (
        "external-redis",
        [
            "--set",
            "redis.enabled=false",
            "--set",
            "redis.external.url=redis://redis.infra:6379/0",
            "--set",
            "redis.auth.existingSecret=infra-redis",
        ],
        2,
    ),
]


@pytest.fixture(scope="module", params=VALUE_SETS, ids=[v[0] for v in VALUE_SETS])
def rendered(request) -> tuple[list[dict], int]:
    _, args, stages = request.param
    return render(*args), stages


def test_helm_lint_passes_default_and_gpu_values():
    helm("lint", "--strict", str(CHART))
    helm("lint", "--strict", str(CHART), "-f", GPU_VALUES)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_rendered_manifests_pass_strict_kubernetes_validation(rendered, version):
    docs, _ = rendered
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_rejects_a_misspelt_field():
    """The validation above can fail: a typo in a rendered manifest is caught."""
    sts = copy.deepcopy(one(render(), "StatefulSet", "worker"))
    sts["spec"]["replica"] = sts["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBERNETES_VERSIONS[-1], strict=True)


def test_service_monitor_scrapes_the_metrics_service():
    # The Prometheus Operator CRD has no schema in kubernetes-validate: every other document is
    # validated, the ServiceMonitor is checked against the Service it must select.
    docs = render("--set", "metrics.enabled=true", "--set", "metrics.serviceMonitor.enabled=true")
    monitor = one(docs, "ServiceMonitor")
    with pytest.raises(SchemaNotFoundError):
        kubernetes_validate.validate(monitor, KUBERNETES_VERSIONS[-1], strict=True)
    for doc in docs:
        if doc["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selected = [
        s
        for s in find(docs, "Service")
        if monitor["spec"]["selector"]["matchLabels"].items() <= labels(s).items()
    ]
    assert len(selected) == 1
    service = selected[0]
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    # the metrics Service reaches router, scheduler and workers, each of which serves metrics
    for component in ("router", "scheduler", "worker"):
        workload = find(docs, "Deployment", component) + find(docs, "StatefulSet", component)
        pod_labels = workload[0]["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items(), component
        (container,) = containers(workload[0])
        assert "metrics" in {p["name"] for p in container["ports"]}
    assert find(render(), "ServiceMonitor") == []  # off by default


def test_worker_statefulset_runs_one_pod_per_stage(rendered, tmp_path):
    docs, stages = rendered
    sts = one(docs, "StatefulSet", "worker")
    assert sts["spec"]["replicas"] == stages
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    (container,) = containers(sts)
    headless = next(
        s
        for s in find(docs, "Service", "worker")
        if s["metadata"]["name"] == sts["spec"]["serviceName"]
    )
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    namespace_suffix = f"{headless['metadata']['name']}.llm.svc.cluster.local"
    dist_addrs = set()
    for ordinal in range(stages):
        pod = f"{sts['metadata']['name']}-{ordinal}"
        argv = worker_argv(container, pod, tmp_path)
        assert argv[:2] == ["conveyor", "worker"]
        got = flags(argv)
        assert got["--stage"] == str(ordinal), pod
        assert got["--stages"] == str(stages), pod
        dist_addrs.add(got["--dist-addr"])
    # every stage meets at stage 0's stable name
    pod0 = f"{sts['metadata']['name']}-0"
    assert dist_addrs == {f"{pod0}.{namespace_suffix}:29500"}


def test_scheduler_lists_every_stage_in_order(rendered, tmp_path):
    docs, stages = rendered
    sts = one(docs, "StatefulSet", "worker")
    (worker,) = containers(sts)
    worker_port = flags(worker_argv(worker, f"{sts['metadata']['name']}-0", tmp_path))["--port"]
    deployment = one(docs, "Deployment", "scheduler")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    (scheduler,) = containers(deployment)
    addrs = flags(container_argv(scheduler))["--workers"].split(",")
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert addrs == [
        f"{name}-{i}.{service}.llm.svc.cluster.local:{worker_port}" for i in range(stages)
    ]


def test_router_reaches_the_scheduler_service(rendered):
    docs, _ = rendered
    (router,) = containers(one(docs, "Deployment", "router"))
    (scheduler,) = containers(one(docs, "Deployment", "scheduler"))
    service = one(docs, "Service", "scheduler")
    host, port = flags(container_argv(router))["--scheduler"].rsplit(":", 1)
    assert host == f"{service['metadata']['name']}.llm.svc.cluster.local"
    assert int(port) == service["spec"]["ports"][0]["port"]
    assert f"--port={service['spec']['ports'][0]['port']}" in scheduler["args"]


def test_every_container_has_probes_and_resources(rendered):
    docs, _ = rendered
    workloads = [d for d in docs if pod_spec(d) is not None]
    assert {labels(d)["app.kubernetes.io/component"] for d in workloads} >= {
        "router",
        "scheduler",
        "worker",
    }
    for doc in workloads:
        for container in containers(doc, init=True):
            where = f"{doc['kind']}/{doc['metadata']['name']}/{container['name']}"
            assert container["resources"].get("requests"), where
            assert container["resources"].get("limits", {}).get("memory"), where
        for container in containers(doc):
            where = f"{doc['kind']}/{doc['metadata']['name']}/{container['name']}"
            assert "livenessProbe" in container and "readinessProbe" in container, where
            if container["name"] in CONVEYOR_CONTAINERS:
                grpc_port = next(
                    p["containerPort"] for p in container["ports"] if p["name"] == "grpc"
                )
                probes = ["startupProbe", "readinessProbe", "livenessProbe"]
                if container["name"] == "router":  # ready as the HTTP API's /health says
                    probes.remove("readinessProbe")
                    ready = container["readinessProbe"]["httpGet"]
                    assert (ready["path"], ready["port"]) == ("/health", "http"), where
                for probe in probes:
                    assert container[probe]["grpc"]["port"] == grpc_port, (where, probe)


def test_only_the_router_is_exposed(rendered):
    docs, _ = rendered
    for service in find(docs, "Service"):
        if labels(service)["app.kubernetes.io/component"] != "router":
            assert service["spec"].get("type", "ClusterIP") == "ClusterIP", service["metadata"]
            assert all("nodePort" not in p for p in service["spec"]["ports"])
    policies = find(docs, "NetworkPolicy")
    router_policy = next(
        p
        for p in policies
        if p["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component")
        == "router"
    )
    # the router's gRPC and HTTP ports are open to everyone
    for port in ("grpc", "http"):
        assert any(
            "from" not in rule and {"port": port, "protocol": "TCP"} in rule["ports"]
            for rule in router_policy["spec"]["ingress"]
        ), port
    internal = next(p for p in policies if p is not router_policy)
    selected = internal["spec"]["podSelector"]["matchExpressions"][0]
    assert selected["key"] == "app.kubernetes.io/component"
    assert set(selected["values"]) == {"worker", "scheduler", "redis"}
    release_pods = {"app.kubernetes.io/name": "conveyor", "app.kubernetes.io/instance": "conv"}
    for rule in internal["spec"]["ingress"]:
        peers = rule["from"]
        if rule.get("ports") == [{"port": "metrics", "protocol": "TCP"}]:
            continue  # scrapers reach the metrics port only
        assert peers == [{"podSelector": {"matchLabels": release_pods}}]


def test_router_serves_the_http_api_on_its_service():
    docs = render()
    (router,) = containers(one(docs, "Deployment", "router"))
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert f"--http-port={ports['http']}" in router["args"]
    (http,) = [p for p in one(docs, "Service", "router")["spec"]["ports"] if p["name"] == "http"]
    assert (http["port"], http["targetPort"], http["appProtocol"]) == (8000, "http", "http")
    tls = render("--set", "security.tls.enabled=true", "--set", "security.tls.existingSecret=t")
    (router,) = containers(one(tls, "Deployment", "router"))
    assert router["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"  # same certificate


def test_router_without_http_has_grpc_probes_only():
    docs = render("--set", "router.httpPort=null")
    (router,) = containers(one(docs, "Deployment", "router"))
    assert not any(a.startswith("--http-port") for a in router["args"])
    assert [p["name"] for p in router["ports"]] == ["grpc"]
    assert router["readinessProbe"]["grpc"]["port"] == router["ports"][0]["containerPort"]
    service_ports = one(docs, "Service", "router")["spec"]["ports"]
    assert [p["name"] for p in service_ports] == ["grpc"]


def test_redis_password_only_from_a_secret():
    secret_value = "s3cret-from-values"
    docs = render("--set", f"redis.auth.password={secret_value}")
    secret = one(docs, "Secret", "redis")
    assert base64.b64decode(secret["data"]["redis-password"]).decode() == secret_value
    rendered_text = helm(
        "template", "conv", str(CHART), "--set", f"redis.auth.password={secret_value}"
    ).stdout
    assert secret_value not in rendered_text  # only its base64 form, inside the Secret
    scheduler_env = containers(one(docs, "Deployment", "scheduler"))[0]["env"]
    (password_env,) = [e for e in scheduler_env if e["name"] == "CONVEYOR_REDIS_PASSWORD"]
    assert password_env["valueFrom"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"],
        "key": "redis-password",
    }
    for doc in docs:
        for container in containers(doc, init=True):
            for env in container.get("env", []):
                if "PASSWORD" in env["name"]:
                    assert "value" not in env and "secretKeyRef" in env["valueFrom"], env
            redis_urls = [a for a in container.get("args", []) if "redis://" in a]
            assert all("@" not in url for url in redis_urls), redis_urls


def test_external_redis_uses_its_secret_and_needs_one():
    docs = render(
        "--set",
        "redis.enabled=false",
        "--set",
        "redis.external.url=redis://redis.infra:6379/0",
        "--set",
        "redis.auth.existingSecret=infra-redis",
    )
    assert find(docs, "StatefulSet", "redis") == [] and find(docs, "Secret", "redis") == []
    (scheduler,) = containers(one(docs, "Deployment", "scheduler"))
    assert flags(container_argv(scheduler))["--redis-url"] == "redis://redis.infra:6379/0"
    (password_env,) = [e for e in scheduler["env"] if e["name"] == "CONVEYOR_REDIS_PASSWORD"]
    assert password_env["valueFrom"]["secretKeyRef"]["name"] == "infra-redis"

    done = helm(
        "template",
        "conv",
        str(CHART),
        "--set",
        "redis.enabled=false",
        "--set",
        "redis.external.url=redis://redis.infra:6379/0",
        check=False,
    )
    assert done.returncode != 0
    assert "redis.auth.existingSecret" in done.stderr


def test_model_fetched_by_init_containers_or_mounted_from_a_claim():
    docs = render()
    for doc in (one(docs, "StatefulSet", "worker"), one(docs, "Deployment", "router")):
        (init,) = pod_spec(doc)["initContainers"]
        assert container_argv(init)[:4] == ["conveyor", "models", "fetch", "smollm2-135m"]
        assert flags(container_argv(init))["--dir"] == "/models"
        volume = next(v for v in pod_spec(doc)["volumes"] if v["name"] == "models")
        assert "emptyDir" in volume
    docs = render("--set", "model.existingClaim=models-pvc")
    for doc in (one(docs, "StatefulSet", "worker"), one(docs, "Deployment", "router")):
        assert "initContainers" not in pod_spec(doc)
        volume = next(v for v in pod_spec(doc)["volumes"] if v["name"] == "models")
        assert volume["persistentVolumeClaim"] == {"claimName": "models-pvc", "readOnly": True}


def test_gpu_values_request_gpus_on_gpu_nodes(tmp_path):
    docs = render("-f", GPU_VALUES)
    sts = one(docs, "StatefulSet", "worker")
    (worker,) = containers(sts)
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    spec = pod_spec(sts)
    assert spec["nodeSelector"] and spec["tolerations"]
    argv = worker_argv(worker, f"{sts['metadata']['name']}-3", tmp_path)
    assert flags(argv)["--device"] == "cuda"
    assert flags(argv)["--stage"] == "3"
    # nothing else asks for a GPU
    for doc in docs:
        for container in containers(doc, init=True):
            if container is not worker:
                assert "nvidia.com/gpu" not in str(container["resources"]), container["name"]


def test_router_scales_and_survives_disruptions():
    docs = render()
    router = one(docs, "Deployment", "router")
    hpa = one(docs, "HorizontalPodAutoscaler", "router")
    assert hpa["spec"]["scaleTargetRef"]["name"] == router["metadata"]["name"]
    assert "replicas" not in router["spec"]  # the HPA owns it
    pdb = one(docs, "PodDisruptionBudget", "router")
    pod_labels = router["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    fixed = one(
        render("--set", "router.autoscaling.enabled=false", "--set", "router.replicas=3"),
        "Deployment",
        "router",
    )
    assert fixed["spec"]["replicas"] == 3


def test_install_notes_tell_how_to_call_the_router():
    done = helm("install", "conv", str(CHART), "--namespace", "llm", "--dry-run=client")
    notes = done.stdout.split("NOTES:", 1)[1]
    assert "grpcurl -plaintext" in notes
    assert "svc/conv-conveyor-router" in notes


def test_block_size_is_the_same_for_scheduler_and_workers(tmp_path):
    docs = render("--set", "pipeline.blockSize=32")
    sts = one(docs, "StatefulSet", "worker")
    (worker,) = containers(sts)
    assert (
        flags(worker_argv(worker, f"{sts['metadata']['name']}-0", tmp_path))["--block-size"] == "32"
    )
    (scheduler,) = containers(one(docs, "Deployment", "scheduler"))
    assert flags(container_argv(scheduler))["--block-size"] == "32"


@pytest.mark.parametrize(
    "values, threads",
    [
        ([], "1"),  # the default request, cpu "1": a container sees all of its node's cores
        (["--set", "worker.resources.requests.cpu=2500m"], "2"),
        (["--set", "worker.resources.requests.cpu=500m"], "1"),
        (["--set-string", "worker.resources.requests.cpu=3"], "3"),
        (["--set", "worker.resources.requests.cpu=3"], "3"),
        (["--set", "worker.resources.limits.cpu=4"], None),  # the worker reads its limit
        (["--set", "worker.threads=6", "--set", "worker.resources.limits.cpu=4"], "6"),
        (["-f", GPU_VALUES], None),
    ],
)
def test_cpu_workers_get_threads_from_their_cpu_request(tmp_path, values, threads):
    sts = one(render(*values), "StatefulSet", "worker")
    (worker,) = containers(sts)
    argv = flags(worker_argv(worker, f"{sts['metadata']['name']}-0", tmp_path))
    assert argv.get("--threads") == threads
