"""The Helm chart's rendered manifests run as local processes: every pod's containers started
with the commands, args and environment the manifests give them (Secret references resolved),
init containers first, a request streamed through the router's Service, and every probe the
manifests declare (startup, readiness, liveness; exec, gRPC and TCP) passing.

How the manifests become processes (the mechanics are in tests/deploy/local_stack.py):

* `helm template` with the default values (release `conv`, namespace `llm`); each StatefulSet
  runs all its replicas as pods `<name>-<ordinal>` (stage i is pod i); each Deployment runs one
  pod, whatever its replica count or autoscaler says (one router answers as well as two);
* argv = `command` + `args` (the image's entry point + `args` without a `command`), HOSTNAME
  = the pod's name, env values and `secretKeyRef`s from the rendered Secret;
* DNS names map to 127.0.0.1: the addresses in the argv, env and probes are rewritten. A
  Service's names (`conv-conveyor-scheduler.llm.svc.cluster.local:50060`, and the shorter
  forms) go to its selected pod's target port; a StatefulSet pod's name under its headless
  Service (`conv-conveyor-worker-0.conv-conveyor-worker.llm.svc.cluster.local:29500`) to that
  pod's port; every container port of every pod gets its own free local port;
* volumes are local directories per pod; the `models` emptyDir already holds SmolLM2-135M (a
  link to the local cache), so the model-fetch init container runs as declared and finds it;
* every pod starts at once (Kubernetes has no start order); the fixture waits until each
  container's startup probe and then its readiness probe pass (`helm install --wait`). A
  container that exits fails the test with its log.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from services.common.proto.conveyor.v1 import common_pb2
from tests.deploy.local_stack import (
    Check,
    Container,
    LocalStack,
    Network,
    image_of,
    seed_models_volume,
    stream,
)
from tests.deploy.utils import CHART, containers, labels, pod_spec, render

pytestmark = [pytest.mark.slow, pytest.mark.smollm2]

NAMESPACE = "llm"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


@dataclass
class Pod:
    name: str
    labels: dict[str, str]
    spec: dict
    subdomain: str | None = None
    """The headless Service a StatefulSet pod is named under."""
    init: list[Container] = field(default_factory=list)
    main: list[Container] = field(default_factory=list)


def pods_of(docs: list[dict]) -> list[tuple[str, dict]]:
    """(pod name, workload) for each pod run locally: every replica of a StatefulSet, one of
    a Deployment."""
    found = []
    for doc in docs:
        if pod_spec(doc) is None:
            continue
        name = doc["metadata"]["name"]
        if doc["kind"] == "StatefulSet":
            found += [(f"{name}-{i}", doc) for i in range(doc["spec"].get("replicas", 1))]
        else:
            assert doc["kind"] == "Deployment", doc["kind"]
            found.append((f"{name}-local", doc))
    return found


def env_of(container: dict, pod: str, secrets: dict[str, dict]) -> dict[str, str]:
    env = {"HOSTNAME": pod}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        ref = item["valueFrom"]
        assert list(ref) == ["secretKeyRef"], f"{item['name']}: no local stand-in for {ref}"
        secret = secrets[ref["secretKeyRef"]["name"]]
        env[item["name"]] = base64.b64decode(secret["data"][ref["secretKeyRef"]["key"]]).decode()
    return env


def container_port(container: dict, port) -> int:
    """A probe's or Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container.get("ports", []) if p["name"] == port)


def checks_of(container: dict, where: str) -> list[Check]:
    checks = []
    for probe in PROBES:
        spec = container.get(probe)
        if spec is None:
            continue
        label = f"{where} {probe}"
        if "exec" in spec:
            checks.append(Check(label, "exec", list(spec["exec"]["command"])))
        elif "grpc" in spec:
            port = container_port(container, spec["grpc"]["port"])
            checks.append(Check(label, "grpc", port=port, service=spec["grpc"].get("service", "")))
        elif "httpGet" in spec:
            assert spec["httpGet"].get("scheme", "HTTP") == "HTTP", f"{label}: {spec}"
            port = container_port(container, spec["httpGet"]["port"])
            checks.append(Check(label, "http", port=port, service=spec["httpGet"]["path"]))
        else:
            assert "tcpSocket" in spec, f"{label}: no local stand-in for {spec}"
            port = container_port(container, spec["tcpSocket"]["port"])
            checks.append(Check(label, "tcp", port=port))
    return checks


def probe_of(check: Check) -> str:
    return check.where.rsplit(" ", 1)[1]


def local_pods(docs: list[dict], root: Path, model_dir: Path) -> tuple[Network, list[Pod]]:
    network = Network(root)
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    domain = yaml.safe_load((CHART / "values.yaml").read_text())["clusterDomain"]
    pods = []
    for name, workload in pods_of(docs):
        spec = pod_spec(workload)
        template_labels = workload["spec"]["template"]["metadata"]["labels"]
        volume_names = [v["name"] for v in spec.get("volumes", [])]
        volume_names += [
            t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])
        ]
        volumes = {v: root / name / "volumes" / v for v in volume_names}
        for path in volumes.values():
            path.mkdir(parents=True, exist_ok=True)
        mounts, ports = {}, set()
        for container in containers(workload, init=True):
            for mount in container.get("volumeMounts", []):
                mounts[mount["mountPath"]] = volumes[mount["name"]]
            ports |= {p["containerPort"] for p in container.get("ports", [])}
        for init in spec.get("initContainers", []):
            if init["args"][:2] == ["models", "fetch"]:
                seed_models_volume(volumes["models"], init["args"][2], model_dir)
        network.add_host(name, sorted(ports), mounts)
        pod = Pod(name, template_labels, spec, workload["spec"].get("serviceName"))
        for container, kind in [(c, "init") for c in spec.get("initContainers", [])] + [
            (c, "main") for c in spec["containers"]
        ]:
            argv = container.get("command") or image_of(container["image"]).entrypoint
            local = Container(
                name=f"{name}/{container['name']}",
                host=name,
                argv=[*argv, *container.get("args", [])],
                env=env_of(container, name, secrets),
                workdir=container.get("workingDir") or image_of(container["image"]).workdir,
                checks=checks_of(container, f"{name}/{container['name']}"),
            )
            (pod.init if kind == "init" else pod.main).append(local)
        pods.append(pod)
    for pod in pods:
        for port in network.ports[pod.name]:
            network.add_route(pod.name, port, pod.name, port)
            if pod.subdomain:
                fqdn = f"{pod.name}.{pod.subdomain}.{NAMESPACE}.svc.{domain}"
                network.add_route(fqdn, port, pod.name, port)
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        selected = [p for p in pods if selector.items() <= p.labels.items()]
        assert selected, f"Service {service['metadata']['name']} selects no pod"
        target_pod = selected[0]
        svc = service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            number = next(
                container_port(c, target)
                for c in target_pod.spec["containers"]
                if isinstance(target, int) or target in {p["name"] for p in c.get("ports", [])}
            )
            for dns in (svc, f"{svc}.{NAMESPACE}", f"{svc}.{NAMESPACE}.svc.{domain}"):
                network.add_route(dns, port["port"], target_pod.name, number)
    return network, pods


def helm_up(stack: LocalStack, pods: list[Pod]) -> None:
    """Every pod at once: its init containers one after another, then its containers; returns
    once every container passed its startup probe and then its readiness probe."""
    next_init = {pod.name: 0 for pod in pods}
    pending = {}
    for pod in pods:
        for c in pod.main:
            pending[c.name] = (c, [k for k in c.checks if probe_of(k) != "livenessProbe"])
    deadline = time.monotonic() + 600
    for pod in pods:
        for container in pod.init[:1] or pod.main:
            stack.start(container)
    while True:
        for pod in pods:
            i = next_init[pod.name]
            if i >= len(pod.init):
                continue
            code = stack.exit_code(pod.init[i].name)
            if code is None:
                continue
            stack.wait_completed(pod.init[i].name)
            next_init[pod.name] = i + 1
            if i + 1 < len(pod.init):
                stack.start(pod.init[i + 1])
            else:
                for container in pod.main:
                    stack.start(container)
        for name, (container, checks) in list(pending.items()):
            if name not in stack.running:
                continue
            stack.assert_alive([name])
            while checks and stack.run_check(container, checks[0])[0]:
                stack.record(f"passed {checks.pop(0).where}")
            if not checks:
                del pending[name]
        if not pending:
            return
        assert time.monotonic() < deadline, f"not ready: {sorted(pending)}: {stack.events}"
        time.sleep(1.0)


@dataclass
class HelmStack:
    stack: LocalStack
    docs: list[dict]
    pods: list[Pod]

    def service_address(self, component: str) -> str:
        """The local address of the component's Service (its first port)."""
        service = next(
            d
            for d in self.docs
            if d["kind"] == "Service"
            and labels(d).get("app.kubernetes.io/component") == component
            and d["spec"].get("clusterIP") != "None"
        )
        name, port = service["metadata"]["name"], service["spec"]["ports"][0]["port"]
        host, container_port = self.stack.network.routes[(name, port)]
        return f"127.0.0.1:{self.stack.network.local_port(host, container_port)}"

    def main_containers(self) -> list[Container]:
        return [c for pod in self.pods for c in pod.main]


@pytest.fixture(scope="module")
def helm_stack(smollm2_dir, tmp_path_factory) -> HelmStack:
    root = tmp_path_factory.mktemp("helm")
    docs = render(release="conv", namespace=NAMESPACE)
    network, pods = local_pods(docs, root, smollm2_dir)
    stack = LocalStack(root, network)
    try:
        helm_up(stack, pods)
        yield HelmStack(stack, docs, pods)
    finally:
        stack.stop()


def test_helm_pods_run_every_stage_and_component(helm_stack):
    names = sorted(c.name for c in helm_stack.main_containers())
    assert names == [
        "conv-conveyor-redis-0/redis",
        "conv-conveyor-router-local/router",
        "conv-conveyor-scheduler-local/scheduler",
        "conv-conveyor-worker-0/worker",
        "conv-conveyor-worker-1/worker",
    ]
    events = helm_stack.stack.events
    for pod, container in [
        ("conv-conveyor-worker-0", "worker"),
        ("conv-conveyor-worker-1", "worker"),
        ("conv-conveyor-router-local", "router"),
    ]:
        fetched = events.index(f"completed {pod}/model-fetch")
        assert fetched < events.index(f"start {pod}/{container}")


def test_helm_router_service_streams_a_request(helm_stack):
    replies = stream(helm_stack.service_address("router"), "The capital of France is", 8)
    assert len(replies) > 1
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert replies[-1].usage.completion_tokens == 8
    assert "Paris" in "".join(r.text for r in replies)


def test_helm_every_probe_passes(helm_stack):
    checked = set()
    for container in helm_stack.main_containers():
        probes = {probe_of(c) for c in container.checks}
        assert {"readinessProbe", "livenessProbe"} <= probes, container.name
        for check in container.checks:
            passed, said = helm_stack.stack.run_check(container, check)
            assert passed, f"{check.where}: {said}"
            checked.add(check.kind)
    assert checked == {"exec", "grpc", "http"}  # http: the router's /health
    helm_stack.stack.assert_alive([c.name for c in helm_stack.main_containers()])


def test_helm_redis_requires_the_secrets_password(helm_stack):
    """The scheduler got in with the Secret's password: a client without it is refused."""
    redis = next(c for c in helm_stack.main_containers() if c.name.endswith("/redis"))
    without = Check("redis-cli without the password", "exec", ["redis-cli", "-p", "6379", "ping"])
    _, said = helm_stack.stack.run_check(redis, without)
    assert "NOAUTH" in said, said
    scheduler = next(c for c in helm_stack.main_containers() if c.name.endswith("/scheduler"))
    log = helm_stack.stack.running[scheduler.name].log.read_text()
    assert "refused to authenticate" not in log and "Traceback" not in log
