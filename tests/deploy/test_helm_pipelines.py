"""The Helm chart with `pipelines: 2` (docs/scale-out.md): a scheduler and a worker set per
pipeline, each selecting only its own pods, schedulers named and listing their own stages,
and routers that reach every scheduler and Redis (for the announcements)."""

from __future__ import annotations

import kubernetes_validate
import pytest

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


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return render("--set", "pipelines=2", "--set", "router.routing=least-load")


def test_two_pipelines_pass_strict_kubernetes_validation(docs):
    for doc in docs:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_each_pipeline_has_its_own_scheduler_and_workers(docs, tmp_path):
    schedulers = find(docs, "Deployment", "scheduler")
    worker_sets = find(docs, "StatefulSet", "worker")
    assert len(schedulers) == len(worker_sets) == 2
    pipelines = []
    for p, (deployment, sts) in enumerate(zip(schedulers, worker_sets, strict=True)):
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector["conveyor.io/pipeline"] == f"p{p}"
        assert sts["spec"]["selector"]["matchLabels"]["conveyor.io/pipeline"] == f"p{p}"
        (scheduler,) = containers(deployment)
        got = flags(container_argv(scheduler))
        assert got["--pipeline-id"] == f"p{p}"
        name = sts["metadata"]["name"]
        assert got["--workers"].split(",") == [
            f"{name}-{i}.{sts['spec']['serviceName']}.llm.svc.cluster.local:50061" for i in range(2)
        ]
        (worker,) = containers(sts)
        assert flags(worker_argv(worker, f"{name}-1", tmp_path))["--dist-addr"].startswith(
            f"{name}-0.{name}."
        )
        pipelines.append((got["--advertise-address"], name))
    assert len({p for p in pipelines}) == 2  # nothing shared between the two


def test_router_reaches_every_scheduler_and_redis(docs):
    (router,) = containers(one(docs, "Deployment", "router"))
    got = flags(container_argv(router))
    services = {s["metadata"]["name"] for s in find(docs, "Service", "scheduler")}
    hosts = {a.rsplit(":", 1)[0].split(".")[0] for a in got["--schedulers"].split(",")}
    assert hosts == services and len(services) == 2
    assert got["--redis-url"].startswith("redis://") and got["--routing"] == "least-load"
    assert "--scheduler" not in got
    env = {e["name"]: e for e in router["env"]}
    assert "secretKeyRef" in env["CONVEYOR_REDIS_PASSWORD"]["valueFrom"]
    for deployment in find(docs, "Deployment", "scheduler"):
        (scheduler,) = containers(deployment)
        assert flags(container_argv(scheduler))["--advertise-address"] in got["--schedulers"]


def test_one_pipeline_renders_as_before():
    """pipelines: 1 (the default) keeps the names and selectors of a lone pipeline."""
    docs = render()
    (deployment,) = find(docs, "Deployment", "scheduler")
    assert "conveyor.io/pipeline" not in deployment["spec"]["selector"]["matchLabels"]
    (router,) = containers(one(docs, "Deployment", "router"))
    assert "--scheduler" in flags(container_argv(router))
    assert "--pipeline-id" not in flags(container_argv(containers(deployment)[0]))
