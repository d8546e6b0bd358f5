"""The Helm chart's credentials: the internal token from a Secret in every Conveyor container,
TLS and mutual TLS from a kubernetes.io/tls Secret (or cert-manager), API keys from a Secret,
and probes that still work (a plaintext health-only port under TLS). The flags the chart
renders are parsed by the real CLI, so a typo fails here."""

from __future__ import annotations

import kubernetes_validate
import pytest

from services.cli import build_parser
from tests.deploy.utils import (
    KUBERNETES_VERSIONS,
    container_argv,
    containers,
    find,
    flags,
    one,
    render,
    worker_argv,
)

TLS = ["--set", "security.tls.enabled=true", "--set", "security.tls.existingSecret=conv-tls"]
KEYS = ["--set", "security.apiKeys.existingSecret=router-keys"]


def _conveyor(docs: list[dict]) -> dict[str, dict]:
    return {
        "router": containers(one(docs, "Deployment", "router"))[0],
        "scheduler": containers(one(docs, "Deployment", "scheduler"))[0],
        "worker": containers(one(docs, "StatefulSet", "worker"))[0],
    }


def _argv(name: str, container: dict, docs: list[dict], tmp_path) -> list[str]:
    if name == "worker":
        sts = one(docs, "StatefulSet", "worker")
        return worker_argv(container, f"{sts['metadata']['name']}-0", tmp_path)
    return container_argv(container)


def test_internal_token_reaches_every_service_from_a_secret_only(tmp_path):
    docs = render()
    secret = next(s for s in find(docs, "Secret") if s["metadata"]["name"].endswith("-token"))
    assert set(secret["data"]) == {"internal-token"}
    for name, container in _conveyor(docs).items():
        (env,) = [e for e in container["env"] if e["name"] == "CONVEYOR_INTERNAL_TOKEN"]
        assert env["valueFrom"]["secretKeyRef"] == {
            "name": secret["metadata"]["name"],
            "key": "internal-token",
        }, name
        assert not any("token" in a for a in _argv(name, container, docs, tmp_path)), name
    theirs = render("--set", "security.internalToken.existingSecret=mine")
    assert not [s for s in find(theirs, "Secret") if s["metadata"]["name"].endswith("-token")]
    router = _conveyor(theirs)["router"]
    (env,) = [e for e in router["env"] if e["name"] == "CONVEYOR_INTERNAL_TOKEN"]
    assert env["valueFrom"]["secretKeyRef"]["name"] == "mine"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_tls_mounts_the_secret_and_probes_use_the_health_port(tmp_path, version):
    docs = render(*TLS, *KEYS)
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    parser = build_parser()
    for name, container in _conveyor(docs).items():
        argv = _argv(name, container, docs, tmp_path)
        args = parser.parse_args(argv[1:])  # the real CLI accepts every rendered flag
        assert (args.tls_cert, args.tls_key, args.tls_ca) == (
            "/tls/tls.crt",
            "/tls/tls.key",
            "/tls/ca.crt",
        ), name
        health = flags(argv)["--health-port"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["health"] == int(health), name
        probes = ["startupProbe", "readinessProbe", "livenessProbe"]
        if name == "router":  # ready as the HTTP API's /health says, over the same TLS
            probes.remove("readinessProbe")
            ready = container["readinessProbe"]["httpGet"]
            assert (ready["port"], ready["scheme"]) == ("http", "HTTPS")
        for probe in probes:
            assert container[probe]["grpc"]["port"] == ports["health"], (name, probe)
        mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")
        assert mount["mountPath"] == "/tls" and mount["readOnly"]
    for kind, component in (("Deployment", "router"), ("StatefulSet", "worker")):
        volumes = one(docs, kind, component)["spec"]["template"]["spec"]["volumes"]
        tls = next(v for v in volumes if v["name"] == "tls")
        assert tls["secret"]["secretName"] == "conv-tls"
    assert find(docs, "Certificate") == []


def test_api_keys_come_from_their_secret(tmp_path):
    docs = render(*KEYS)
    router = _conveyor(docs)["router"]
    assert flags(container_argv(router))["--api-key-file"] == "/keys/api-keys"
    volumes = one(docs, "Deployment", "router")["spec"]["template"]["spec"]["volumes"]
    keys = next(v for v in volumes if v["name"] == "api-keys")
    assert keys["secret"]["secretName"] == "router-keys"
    assert "--api-key-file" not in flags(container_argv(_conveyor(render())["router"]))


def test_cert_manager_issues_one_certificate_for_every_service():
    docs = render(
        "--set",
        "security.tls.enabled=true",
        "--set",
        "security.tls.certManager.enabled=true",
        "--set",
        "security.tls.certManager.issuerRef.name=internal-ca",
    )
    certificate = one(docs, "Certificate")
    spec = certificate["spec"]
    workers = one(docs, "StatefulSet", "worker")["spec"]["serviceName"]
    scheduler = one(docs, "Service", "scheduler")["metadata"]["name"]
    assert f"*.{workers}.llm.svc.cluster.local" in spec["dnsNames"]
    assert f"{scheduler}.llm.svc.cluster.local" in spec["dnsNames"]
    assert {"server auth", "client auth"} <= set(spec["usages"])
    assert spec["issuerRef"]["name"] == "internal-ca"
    tls = next(
        v
        for v in one(docs, "Deployment", "scheduler")["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "tls"
    )
    assert tls["secret"]["secretName"] == spec["secretName"]
