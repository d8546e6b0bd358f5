"""docker-compose.yml: the Compose v2 binary accepts it, and the stack it describes starts in a
working order (fetch once, both stages at one rendezvous, scheduler over both, router published)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.utils import REPO, clean_env, compose_binary, flags

COMPOSE_FILE = REPO / "docker-compose.yml"
CONVEYOR_SERVICES = ("model-fetch", "worker-0", "worker-1", "scheduler", "router")


def compose(project_dir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        str(compose_binary()),
        "--project-directory",
        str(project_dir),
        "-f",
        str(project_dir / "docker-compose.yml"),
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env())


@pytest.fixture(scope="module")
def stack() -> dict:
    """The resolved model (anchors merged, variables at their defaults)."""
    done = compose(REPO, "config", "--format", "json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["services"]


def test_compose_config_accepts_the_file():
    done = compose(REPO, "config", "-q")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("condition: service_completed_successfully", "condition: service_finished"),
        (
            "      worker-1:\n        condition: service_healthy",
            "      worker-9:\n        condition: service_healthy",
        ),
    ],
    ids=["bad-condition", "unknown-dependency"],
)
def test_compose_config_rejects_a_broken_copy(tmp_path, old, new):
    text = COMPOSE_FILE.read_text()
    assert old in text
    (tmp_path / "docker-compose.yml").write_text(text.replace(old, new, 1))
    shutil.copy(REPO / "Dockerfile", tmp_path / "Dockerfile")
    done = compose(tmp_path, "config", "-q")
    assert done.returncode != 0


def test_only_the_router_is_published(stack):
    published = {name for name, svc in stack.items() if svc.get("ports")}
    assert published == {"router"}
    grpc_port, http_port = stack["router"]["ports"]
    assert (grpc_port["target"], grpc_port["published"]) == (50051, "50051")
    assert (http_port["target"], http_port["published"]) == (8000, "8000")
    assert "--http-port=8000" in stack["router"]["command"]


def test_model_fetched_once_before_anything_that_reads_it(stack):
    fetch = stack["model-fetch"]
    assert fetch["restart"] == "no"
    assert fetch["command"][:3] == ["models", "fetch", "smollm2-135m"]
    assert flags(fetch["command"])["--dir"] == "/models"
    for name in ("worker-0", "worker-1", "router"):
        depends = stack[name]["depends_on"]["model-fetch"]
        assert depends["condition"] == "service_completed_successfully", name
        mount = next(v for v in stack[name]["volumes"] if v["target"] == "/models")
        assert mount["source"] == "models" and mount.get("read_only"), name


def test_workers_form_one_two_stage_pipeline(stack):
    argvs = {name: flags(stack[name]["command"]) for name in ("worker-0", "worker-1")}
    assert [stack[n]["command"][0] for n in argvs] == ["worker", "worker"]
    assert [argvs[n]["--stage"] for n in ("worker-0", "worker-1")] == ["0", "1"]
    assert {a["--stages"] for a in argvs.values()} == {"2"}
    # both meet at stage 0's rendezvous; neither waits for the other (it would never start)
    assert {a["--dist-addr"] for a in argvs.values()} == {"worker-0:29500"}
    for name in argvs:
        assert not {"worker-0", "worker-1"} & set(stack[name].get("depends_on", {}))


def test_scheduler_waits_for_redis_and_lists_both_stages(stack):
    scheduler = stack["scheduler"]
    got = flags(scheduler["command"])
    ports = [flags(stack[n]["command"])["--port"] for n in ("worker-0", "worker-1")]
    assert got["--workers"] == f"worker-0:{ports[0]},worker-1:{ports[1]}"
    assert got["--redis-url"] == "redis://redis:6379/0"  # no password in the URL
    assert (
        scheduler["environment"]["CONVEYOR_REDIS_PASSWORD"]
        == stack["redis"]["environment"]["REDIS_PASSWORD"]
    )
    conditions = {k: v["condition"] for k, v in scheduler["depends_on"].items()}
    assert conditions == {
        "redis": "service_healthy",
        "worker-0": "service_healthy",
        "worker-1": "service_healthy",
    }
    router = flags(stack["router"]["command"])
    assert router["--scheduler"] == f"scheduler:{got['--port']}"
    assert stack["router"]["depends_on"]["scheduler"]["condition"] == "service_healthy"


def test_healthchecks_use_conveyor_health_on_each_service_port(stack):
    for name in ("worker-0", "worker-1", "scheduler", "router"):
        port = flags(stack[name]["command"])["--port"]
        assert stack[name]["healthcheck"]["test"] == [
            "CMD",
            "conveyor",
            "health",
            f"127.0.0.1:{port}",
        ], name
        assert stack[name]["restart"] == "unless-stopped"
    redis = stack["redis"]
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert any(v["source"] == "redis-data" and v["type"] == "volume" for v in redis["volumes"])


def test_every_interpolated_variable_is_documented():
    text = COMPOSE_FILE.read_text()
    used = set(re.findall(r"\$\{(CONVEYOR_[A-Z_]+)", text))
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    docs = (REPO / "docs" / "deployment.md").read_text()
    assert used, "no variables found: the pattern is stale"
    for var in sorted(used):
        assert var in header, f"{var} is not described in docker-compose.yml's header"
        assert var in docs, f"{var} is not described in docs/deployment.md"


def test_one_image_for_every_conveyor_service(stack):
    images = {stack[name]["image"] for name in CONVEYOR_SERVICES}
    assert images == {"conveyor:latest"}
    for name in CONVEYOR_SERVICES:
        assert stack[name]["build"]["args"]["BASE"] == "cpu"


def test_compose_file_runs_on_engines_before_docker_25(stack):
    """`healthcheck.start_interval` needs Docker 25 (API 1.44): Podman 4's Docker API (1.41)
    and older Docker refuse the whole file."""
    lines = [line.split("#", 1)[0] for line in COMPOSE_FILE.read_text().splitlines()]
    assert not [line for line in lines if "start_interval" in line]
    for name, svc in stack.items():
        assert "start_interval" not in svc.get("healthcheck", {}), name


def test_dockerfile_torch_source_is_a_build_arg():
    """`--build-arg TORCH_INDEX_URL=...` / `TORCH_WHEELS=...` reach the torch install: both are
    ARGs of the build stage, and no ENV of the same name (which would win) is set anywhere."""
    text = (REPO / "Dockerfile").read_text()
    build_stage = text.split(" AS build\n", 1)[1].split("\nFROM ", 1)[0]
    for arg in ("TORCH_INDEX_URL", "TORCH_WHEELS"):
        assert re.search(rf"^ARG {arg}\b", build_stage, re.M), arg
        assert not re.search(rf"^ENV(\s.*)?\s{arg}=", text, re.M), f"an ENV sets {arg}"
        assert not re.search(rf"^\s+{arg}=", text, re.M), f"an ENV continuation sets {arg}"
    (install,) = [r for r in build_stage.split("\nRUN ") if "pip install ${from} " in r]
    assert "${TORCH_INDEX_URL:-" in install and "${TORCH_WHEELS}" in install


def test_pipelines_profile_adds_a_second_pipeline_the_router_discovers():
    """`--profile pipelines`: pipeline p1 (two workers at their own rendezvous, a scheduler
    over them); both schedulers announce themselves in Redis, where the router looks."""
    done = compose(REPO, "--profile", "pipelines", "config", "--format", "json")
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    p0, p1 = flags(services["scheduler"]["command"]), flags(services["scheduler-p1"]["command"])
    assert (p0["--pipeline-id"], p1["--pipeline-id"]) == ("p0", "p1")
    assert p1["--workers"] == "worker-p1-0:50061,worker-p1-1:50061"
    assert p0["--redis-url"] == p1["--redis-url"]
    for name in ("worker-p1-0", "worker-p1-1"):
        assert flags(services[name]["command"])["--dist-addr"] == "worker-p1-0:29500"
    router = flags(services["router"]["command"])
    assert router["--redis-url"] == p0["--redis-url"]
    assert services["router"]["environment"]["CONVEYOR_REDIS_PASSWORD"]
    published = {name for name, svc in services.items() if svc.get("ports")}
    assert published == {"router"}


def test_pipelines_profile_is_off_by_default(stack):
    assert not {"worker-p1-0", "worker-p1-1", "scheduler-p1"} & set(stack)
