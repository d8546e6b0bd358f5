"""The scheduler against a password-protected Redis (real redis-server with requirepass): the
password from CONVEYOR_REDIS_PASSWORD / _FILE or the URL, TLS (`rediss://`), and a wrong
password that keeps the scheduler up and NOT_SERVING with one clear line per try."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import StateStoreError
from services.common.redis_auth import PASSWORD_ENV, PASSWORD_FILE_ENV, redis_connection_kwargs
from services.common.redis_server import RedisServer, TlsFiles, free_port
from services.launcher import child_env, wait_serving
from services.scheduler.scheduler import Scheduler
from services.scheduler.store import RedisStateStore
from tests.scheduler.utils import make_config, make_request

PASSWORD = 'pa ss"wo\\rd'  # a space, a quote and a backslash survive the config file
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def protected_redis():
    with RedisServer(password=PASSWORD) as server:
        yield server


def roundtrip(store: RedisStateStore) -> None:
    """Write a request and read it back through the store."""
    scheduler = Scheduler(make_config(), store)
    scheduler.add_request(make_request("auth", 4, 1))
    assert [r.request_id for r in store.load_unfinished()] == ["auth"]


def test_store_password_from_the_environment(protected_redis):
    store = RedisStateStore(
        protected_redis.url, **redis_connection_kwargs({PASSWORD_ENV: PASSWORD})
    )
    store._client.flushdb()
    roundtrip(store)


def test_store_password_from_a_file(protected_redis, tmp_path):
    secret = tmp_path / "redis-password"
    secret.write_text(PASSWORD + "\n")
    kwargs = redis_connection_kwargs({PASSWORD_FILE_ENV: str(secret)})
    store = RedisStateStore(protected_redis.url, **kwargs)
    store._client.flushdb()
    roundtrip(store)


def test_store_password_in_the_url_still_works_and_is_not_shown(protected_redis):
    url = f"redis://:pw-in-url@127.0.0.1:{protected_redis.port}/0"
    client = redis.Redis.from_url(protected_redis.url, password=PASSWORD)
    client.config_set("requirepass", "pw-in-url")
    try:
        # the URL's password wins over a stale one in the environment
        store = RedisStateStore(url, **redis_connection_kwargs({PASSWORD_ENV: "stale"}))
        store._client.flushdb()
        roundtrip(store)
        assert "pw-in-url" not in store.url
    finally:
        client.config_set("requirepass", PASSWORD)
        client.close()


@pytest.mark.parametrize("password", [None, "wrong"], ids=["none", "wrong"])
def test_store_refused_password_names_the_variables(protected_redis, password):
    store = RedisStateStore(protected_redis.url, timeout_s=2.0, password=password)
    with pytest.raises(StateStoreError) as caught:
        store.load_unfinished()
    message = str(caught.value)
    assert "refused to authenticate" in message
    assert PASSWORD_ENV in message and PASSWORD_FILE_ENV in message
    assert PASSWORD not in message


def test_redis_server_with_a_password_refuses_clients_without_it(protected_redis):
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(protected_redis.url).ping()
    assert redis.Redis.from_url(protected_redis.url, password=PASSWORD).ping()
    # the password is not on redis-server's command line (visible to every local user)
    cmdline = Path(f"/proc/{protected_redis.proc.pid}/cmdline").read_bytes()
    assert PASSWORD.encode() not in cmdline


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> TlsFiles:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is needed to make a test certificate")
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    cmd = [
        openssl,
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=127.0.0.1",
        "-addext",
        "subjectAltName=IP:127.0.0.1",
        "-keyout",
        str(key),
        "-out",
        str(cert),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    return TlsFiles(cert, key)


def test_store_over_tls_with_a_password(tls_files):
    with RedisServer(password=PASSWORD, tls=tls_files) as server:
        assert server.url.startswith("rediss://")
        url = f"{server.url}?ssl_ca_certs={tls_files.cert}"
        store = RedisStateStore(url, **redis_connection_kwargs({PASSWORD_ENV: PASSWORD}))
        roundtrip(store)
        # the certificate is checked: a client that does not trust it is refused
        untrusted = RedisStateStore(server.url, timeout_s=2.0, password=PASSWORD)
        with pytest.raises(StateStoreError, match="did not answer"):
            untrusted.load_unfinished()


# -- the scheduler process ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from services.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", num_layers=2)


def spawn(argv: list[str], log: Path, **env: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.cli", *argv]
    base = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=child_env({**base, **env}), stderr=out)


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_scheduler_with_a_wrong_password_waits_not_serving(
    protected_redis, tiny_model_dir, tmp_path
):
    worker_port, scheduler_port = free_port(), free_port()
    worker = spawn(
        [
            "worker",
            f"--model={tiny_model_dir}",
            "--stage=0",
            "--stages=1",
            f"--dist-addr=127.0.0.1:{free_port()}",
            f"--port={worker_port}",
            "--kv-cache-memory=16MiB",
            "--threads=1",
        ],
        tmp_path / "worker.log",
    )
    log = tmp_path / "scheduler.log"
    scheduler = spawn(
        [
            "scheduler",
            f"--workers=127.0.0.1:{worker_port}",
            f"--redis-url={protected_redis.url}",
            f"--port={scheduler_port}",
        ],
        log,
        **{PASSWORD_ENV: "wrong-password"},
    )
    address = f"127.0.0.1:{scheduler_port}"
    admin = redis.Redis.from_url(protected_redis.url, password=PASSWORD)
    try:
        wait_until(lambda: "refused to authenticate" in log.read_text(), scheduler)
        assert scheduler.poll() is None, log.read_text()
        assert health(address, "") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert health(address, "liveness") == health_pb2.HealthCheckResponse.SERVING
        text = log.read_text()
        assert "Traceback" not in text and "wrong-password" not in text
        assert PASSWORD_ENV in text
        # Redis's side is fixed (here: its password changed to the one the scheduler has):
        # the next try gets in, without a restart
        admin.config_set("requirepass", "wrong-password")
        wait_serving(address, 120, scheduler)
    finally:
        admin.config_set("requirepass", PASSWORD)
        admin.close()
        for proc in (scheduler, worker):
            proc.terminate()
        for proc in (scheduler, worker):
            proc.wait(timeout=30)


def test_scheduler_names_a_refused_password_before_its_stages_are_up(protected_redis, tmp_path):
    """No worker answers yet: the log says what is wrong with Redis now, not once the
    stages are up (it said nothing while it waited for them)."""
    log = tmp_path / "scheduler.log"
    scheduler = spawn(
        [
            "scheduler",
            f"--workers=127.0.0.1:{free_port()}",  # nothing listens there
            f"--redis-url={protected_redis.url}",
            f"--port={free_port()}",
        ],
        log,
        **{PASSWORD_ENV: "wrong-password"},
    )
    try:
        wait_until(lambda: "refused to authenticate" in log.read_text(), scheduler, 60)
    finally:
        scheduler.terminate()
        scheduler.wait(timeout=30)


def wait_until(predicate, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"exited with {proc.returncode}"
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)
