"""Row 4 of issue 13, `conveyor up`: every port of the stack listens on 127.0.0.1 only (the
workers, the scheduler, the rendezvous, gloo's sockets, the router), the unauthenticated
mode is said in the log, and clients on this machine need no credential."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.client.client import ConveyorClient
from services.launcher import wait_serving
from tests.conftest import free_port
from tests.processes import stop_process

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:  # the thread (or process) ended since the listing
                continue
            found += [int(c) for c in children]
            todo += [int(c) for c in children]
    return found


def _listening(pids: list[int]) -> set[tuple[str, int]]:
    """(local address, port) of every TCP socket in LISTEN state owned by `pids`."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    sockets = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address, port = local.split(":")
            sockets.add((_address(address, width), int(port, 16)))
    return sockets


def _address(hex_address: str, width: int) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_address)
    # /proc/net writes each 32-bit word in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    if width == 32 and address.ipv4_mapped:
        return str(address.ipv4_mapped)
    return str(address)


@pytest.fixture(scope="module")
def up(tiny_dir, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("up") / "conveyor-up.log"
    argv = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--no-http",
        "--model",
        str(tiny_dir),
        "--stages",
        "2",
        "--threads",
        "1",
        "--kv-cache-memory",
        "32MiB",
        "--port",
        str(port),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("CONVEYOR_INTERNAL_TOKEN", "CONVEYOR_TLS_CERT", "CONVEYOR_TLS_KEY"):
        env.pop(name, None)
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_serving(f"127.0.0.1:{port}", 300, proc)
        yield proc, f"127.0.0.1:{port}", log_path
    finally:
        stop_process(proc)


def test_up_listens_on_loopback_only(up):
    proc, _, _ = up
    sockets = _listening([proc.pid, *_descendants(proc.pid)])
    # router, scheduler, 2 workers, the rendezvous, Redis, gloo: several ports, each on lo
    assert len(sockets) >= 6, sockets
    exposed = sorted(s for s in sockets if s[0] not in ("127.0.0.1", "::1"))
    assert not exposed, f"listening beyond this machine: {exposed}"


def test_up_serves_local_clients_without_credentials_and_says_so(up):
    _, address, log_path = up
    with ConveyorClient(address, timeout_s=120) as client:
        result = client.complete("hello", max_tokens=4, ignore_eos=True)
    assert (result.finish_reason, len(result.token_ids)) == ("length", 4)
    log = log_path.read_text()
    assert "unauthenticated mode" in log
    assert "every caller is anonymous" in log
