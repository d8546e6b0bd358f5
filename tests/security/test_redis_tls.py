"""`rediss://` URLs: the scheduler's state store talks TLS to Redis (redis-py does it from the
URL; a private CA comes as `?ssl_ca_certs=PATH`), and refuses a server it cannot verify."""

from __future__ import annotations

import subprocess
import time

import pytest

from services.common.certs import write_certs
from services.common.errors import StateStoreError
from services.common.redis_server import find_redis_server
from services.scheduler.request import Request
from services.scheduler.store import RedisStateStore
from tests.conftest import free_port


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    folder = tmp_path_factory.mktemp("redis-tls")
    certs = write_certs(folder / "certs")
    port = free_port()
    argv = [
        find_redis_server(),
        "--port",
        "0",
        "--tls-port",
        str(port),
        "--tls-cert-file",
        str(certs.cert),
        "--tls-key-file",
        str(certs.key),
        "--tls-ca-cert-file",
        str(certs.ca),
        "--tls-auth-clients",
        "no",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(folder),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"rediss://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 20
    while True:
        try:
            RedisStateStore(f"{url}?ssl_ca_certs={certs.ca}").read_state("probe")
            break
        except StateStoreError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("redis-server with TLS did not start")
            time.sleep(0.2)
    yield url, certs.ca
    proc.terminate()
    proc.wait(timeout=10)


def test_state_store_over_rediss(tls_redis):
    url, ca = tls_redis
    store = RedisStateStore(f"{url}?ssl_ca_certs={ca}")
    store.add(Request("tls-1", [1, 2, 3], owner_token="owner"))
    assert store.read_owner_token("tls-1") == "owner"
    assert [r.request_id for r in store.load_unfinished()] == ["tls-1"]
    store.close()


def test_rediss_refuses_a_server_it_cannot_verify(tls_redis):
    url, _ = tls_redis
    with pytest.raises(StateStoreError, match="CERTIFICATE_VERIFY_FAILED"):
        RedisStateStore(url).read_state("x")
