"""docker-compose.yml's internal token and docker-compose.tls.yml: every Conveyor service gets
the same token; with the TLS file, a one-shot `conveyor certs` makes a certificate valid for
every name the services call each other by, and every service (its healthcheck too) reads it."""

from __future__ import annotations

import json
import subprocess
from urllib.parse import urlsplit

import pytest

from services.cli import build_parser
from tests.deploy.utils import REPO, clean_env, compose_binary, flags

SERVICES = ("worker-0", "worker-1", "scheduler", "router")


def _config(*files: str) -> dict:
    args = [arg for name in files for arg in ("-f", str(REPO / name))]
    done = subprocess.run(
        [
            str(compose_binary()),
            "--project-directory",
            str(REPO),
            *args,
            "config",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["services"]


@pytest.fixture(scope="module")
def tls() -> dict:
    return _config("docker-compose.yml", "docker-compose.tls.yml")


def test_every_service_shares_one_internal_token():
    stack = _config("docker-compose.yml")
    tokens = {stack[name]["environment"]["CONVEYOR_INTERNAL_TOKEN"] for name in SERVICES}
    assert len(tokens) == 1 and "" not in tokens


def test_tls_file_gives_every_service_the_certificate(tls, monkeypatch):
    for name in SERVICES:
        env = tls[name]["environment"]
        assert (env["CONVEYOR_TLS_CERT"], env["CONVEYOR_TLS_KEY"], env["CONVEYOR_TLS_CA"]) == (
            "/certs/tls.crt",
            "/certs/tls.key",
            "/certs/ca.crt",
        ), name
        mount = next(v for v in tls[name]["volumes"] if v["target"] == "/certs")
        assert mount["source"] == "certs" and mount.get("read_only"), name
        assert tls[name]["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    # and their healthchecks speak TLS: `conveyor health` reads the same variables
    for key, value in tls["router"]["environment"].items():
        monkeypatch.setenv(key, value)
    health = build_parser().parse_args(tls["router"]["healthcheck"]["test"][2:])
    assert (health.tls_ca, health.tls_cert) == ("/certs/ca.crt", "/certs/tls.crt")


def test_certificate_names_every_address_the_services_use(tls):
    certs = tls["certs"]
    assert certs["restart"] == "no"
    args = build_parser().parse_args(certs["command"])
    assert args.out == "/certs"
    names = set(args.hosts.split(",")) | {"localhost", "127.0.0.1"}
    scheduler = flags(tls["scheduler"]["command"])
    used = {urlsplit(f"//{a}").hostname for a in scheduler["--workers"].split(",")}
    used.add(urlsplit(f"//{flags(tls['router']['command'])['--scheduler']}").hostname)
    used.add(urlsplit(f"//{flags(tls['worker-1']['command'])['--dist-addr']}").hostname)
    assert used <= names, used - names
