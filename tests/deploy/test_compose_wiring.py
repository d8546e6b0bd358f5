"""docker-compose.yml run as local processes: every service started exactly as the file declares
it, a request streamed through the router, and every healthcheck the file declares passing.

How the file becomes processes (the mechanics are in tests/deploy/local_stack.py):

* the services are `docker compose config`'s resolved model: variables at their defaults
  (CONVEYOR_* are removed from the environment), anchors merged; `$$`, compose's escape for
  `$`, is unescaped as compose does when it creates a container;
* argv = the image's entry point (the Dockerfile's ENTRYPOINT for the conveyor image; none for
  redis, whose entry point runs a command as given) + `command`; environment = `environment`;
* service names map to 127.0.0.1: the addresses in the argv, environment and healthchecks are
  rewritten (`worker-0:29500`, `redis://redis:6379/0`, and `127.0.0.1:50061` in worker-1's own
  healthcheck each become 127.0.0.1 and that container port's own free local port, exposed or
  published alike); the named volumes are local directories;
* the `models` volume already holds SmolLM2-135M (a link to the local cache): model-fetch's
  command runs as declared and finds it there, without network;
* start order is compose's: a service starts once each of its depends_on conditions holds
  (service_healthy: its healthcheck command passed; service_completed_successfully: it exited
  0), then the fixture waits as `up --wait` does. A service that exits (other than the
  `restart: "no"` one-shot) fails the test with its log.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

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
from tests.deploy.utils import REPO, clean_env, compose_binary

pytestmark = [pytest.mark.slow, pytest.mark.smollm2]


def unescape(text: str) -> str:
    return text.replace("$$", "$")


def compose_services() -> dict[str, dict]:
    cmd = [
        str(compose_binary()),
        "--project-directory",
        str(REPO),
        "-f",
        str(REPO / "docker-compose.yml"),
        "config",
        "--format",
        "json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env())
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["services"]


def local_containers(
    services: dict[str, dict], root: Path, models_volume: Path
) -> tuple[Network, dict[str, Container]]:
    """The compose services as local containers, one host per service."""
    network = Network(root)
    volumes = {"models": models_volume}
    for name, svc in services.items():
        image = image_of(svc["image"])
        ports = {int(p) for p in svc.get("expose", [])}
        ports |= {int(p["target"]) for p in svc.get("ports", [])} | set(image.ports)
        mounts = {}
        for volume in svc.get("volumes", []):
            assert volume["type"] == "volume", f"{name}: only named volumes run locally"
            source = volume["source"]
            volumes.setdefault(source, root / "volumes" / source)
            volumes[source].mkdir(parents=True, exist_ok=True)
            mounts[volume["target"]] = volumes[source]
        network.add_host(name, sorted(ports), mounts)
    containers = {}
    for name, svc in services.items():
        image = image_of(svc["image"])
        for alias in {name, svc.get("hostname", name)}:
            for port in network.ports[name]:
                network.add_route(alias, port, name, port)
        checks = []
        test = svc.get("healthcheck", {}).get("test")
        if test:
            argv = test[1:] if test[0] == "CMD" else ["/bin/sh", "-c", test[1]]
            assert test[0] in ("CMD", "CMD-SHELL"), test
            checks.append(Check(f"{name} healthcheck", "exec", [unescape(a) for a in argv]))
        argv = (svc.get("entrypoint") or image.entrypoint) + (svc.get("command") or [])
        containers[name] = Container(
            name=name,
            host=name,
            argv=[unescape(a) for a in argv],
            env={k: unescape(v or "") for k, v in (svc.get("environment") or {}).items()},
            workdir=svc.get("working_dir") or image.workdir,
            checks=checks,
        )
    return network, containers


def compose_up(
    stack: LocalStack, services: dict[str, dict], containers: dict[str, Container]
) -> None:
    """Starts each service once its depends_on conditions hold; returns when every service with
    a healthcheck is healthy and every exited one completed (`docker compose up --wait`)."""
    started, healthy, completed = set(), set(), set()
    conditions = {
        "service_started": started,
        "service_healthy": healthy,
        "service_completed_successfully": completed,
    }
    deadline = time.monotonic() + 600
    while True:
        for name, svc in services.items():
            depends = (svc.get("depends_on") or {}).items()
            if name not in started and all(dep in conditions[c["condition"]] for dep, c in depends):
                stack.start(containers[name])
                started.add(name)
        for name in sorted(started - healthy - completed):
            code = stack.exit_code(name)
            if code is not None:
                assert code == 0, f"{name} exited with {code}:\n{stack.log_tail(name)}"
                assert services[name].get("restart") == "no", (
                    f"{name} exited:\n{stack.log_tail(name)}"
                )
                completed.add(name)
                stack.record(f"completed {name}")
            elif (
                containers[name].checks
                and stack.run_check(containers[name], containers[name].checks[0])[0]
            ):
                healthy.add(name)
                stack.record(f"healthy {name}")
        waiting = {n for n in services if n not in started}
        waiting |= {n for n in started - completed if containers[n].checks and n not in healthy}
        if not waiting:
            return
        assert time.monotonic() < deadline, f"still waiting for {sorted(waiting)}: {stack.events}"
        time.sleep(1.0)


@dataclass
class ComposeStack:
    stack: LocalStack
    services: dict[str, dict]
    containers: dict[str, Container]

    def published(self, service: str, target: int) -> str:
        """The local address standing for the host port a `ports:` entry publishes."""
        return f"127.0.0.1:{self.stack.network.local_port(service, target)}"


@pytest.fixture(scope="module")
def compose_stack(smollm2_dir, tmp_path_factory) -> ComposeStack:
    root = tmp_path_factory.mktemp("compose")
    services = compose_services()
    fetch = services["model-fetch"]["command"]
    models = seed_models_volume(root / "volumes" / "models", fetch[2], smollm2_dir)
    network, containers = local_containers(services, root, models)
    stack = LocalStack(root, network)
    try:
        compose_up(stack, services, containers)
        yield ComposeStack(stack, services, containers)
    finally:
        stack.stop()


def test_compose_services_start_in_the_declared_order(compose_stack):
    events = compose_stack.stack.events
    at = {event: i for i, event in enumerate(events)}
    for worker in ("worker-0", "worker-1"):
        assert at["completed model-fetch"] < at[f"start {worker}"] < at[f"healthy {worker}"]
        assert at[f"healthy {worker}"] < at["start scheduler"]
    assert at["healthy redis"] < at["start scheduler"] < at["healthy scheduler"]
    assert at["healthy scheduler"] < at["start router"]


def test_compose_router_streams_a_request(compose_stack):
    grpc_port, http_port = compose_stack.services["router"]["ports"]
    address = compose_stack.published("router", int(grpc_port["target"]))
    replies = stream(address, "The capital of France is", max_tokens=8)
    assert len(replies) > 1  # streamed, not one reply
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert replies[-1].usage.completion_tokens == 8
    text = "".join(r.text for r in replies)
    assert "Paris" in text
    # the same greedy answer from the OpenAI-compatible API on the other published port
    http = compose_stack.published("router", int(http_port["target"]))
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(
        f"http://{http}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())
    assert answer["choices"][0]["text"] == text


def test_compose_every_healthcheck_passes(compose_stack):
    checked = []
    for name, container in compose_stack.containers.items():
        for check in container.checks:
            passed, said = compose_stack.stack.run_check(container, check)
            assert passed, said
            checked.append(name)
    assert sorted(checked) == ["redis", "router", "scheduler", "worker-0", "worker-1"]
    compose_stack.stack.assert_alive([n for n in compose_stack.containers if n != "model-fetch"])


def test_compose_redis_requires_the_password_the_scheduler_uses(compose_stack):
    """The scheduler got in with the password (its only way): a client without it is refused."""
    redis = compose_stack.containers["redis"]
    without = Check("redis-cli without the password", "exec", ["redis-cli", "ping"])
    passed, said = compose_stack.stack.run_check(redis, without)
    assert "NOAUTH" in said, said
    log = compose_stack.stack.running["scheduler"].log.read_text()
    assert "refused to authenticate" not in log and "Traceback" not in log
