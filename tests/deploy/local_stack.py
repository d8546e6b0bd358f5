"""Deployment manifests run as local processes: one process per container, all on 127.0.0.1.

What a manifest declares for a container (its argv, environment and health checks) is taken
as it is; then `Network.localize` rewrites the addresses in each of those strings:

* `HOST:PORT`, where HOST is a name the container reaches another one by (a compose service,
  a Kubernetes Service or pod DNS name) or its own loopback (`127.0.0.1`, `localhost`,
  `0.0.0.0`, `[::]`), becomes `127.0.0.1:LOCAL`;
* `--port N`, `--port=N` and `-p N` naming one of the host's own ports become its LOCAL port;
* a volume's mount path (`/models`, `/data`) becomes the local directory standing for it.

Every port of every host (a compose service, a Kubernetes pod) gets its own free local port.
The image's programs are stand-ins on PATH (`<host dir>/bin`): `conveyor` runs this checkout
(`python -m services.cli`); `redis-server` and `redis-cli` are the machine's, bound to
127.0.0.1 and, where the command names no port, on the host's mapped Redis port instead of
the image's default 6379 (where the machine's own Redis may listen).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.proto.conveyor.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.common.redis_server import find_redis_server, free_port
from services.launcher import child_env
from tests.deploy.utils import REPO, clean_env

LOOPBACK = ("127.0.0.1", "localhost", "0.0.0.0", "[::]")
REDIS_DEFAULT_PORT = 6379
CHECK_TIMEOUT_S = 60.0
"""Every check gets this long, whatever the manifest says: the machine is shared and slow."""
_ADDRESS = re.compile(r"(?<![\w.-])(\[::\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):(\d{1,5})\b")
# --port, and --<name>-port= flags (--http-port, --health-port, ...) of a port the host declares
_PORT_FLAG = re.compile(r"(?<!\S)(--(?:[a-z]+-)?port=|--port\s+|-p\s+)(\d{1,5})\b")


@dataclass
class Check:
    """A health check as declared: a command (`exec`), or a gRPC health, HTTP GET or TCP
    probe."""

    where: str
    kind: str
    argv: list[str] = field(default_factory=list)
    port: int | None = None
    """Container port of a `grpc` / `http` / `tcp` probe."""
    service: str = ""
    """gRPC health service name ("" = the server as a whole); an `http` probe's path."""


@dataclass
class Container:
    """One container of a host, as the manifest declares it (addresses not yet rewritten)."""

    name: str
    host: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    """The working directory in the image (a mount path, or None for a fresh directory)."""
    checks: list[Check] = field(default_factory=list)


class Network:
    """Names and ports of every host, mapped to 127.0.0.1 and free local ports."""

    def __init__(self, root: Path):
        self.root = root
        self.ports: dict[str, dict[int, int]] = {}
        """host -> container port -> local port."""
        self.routes: dict[tuple[str, int], tuple[str, int]] = {}
        """(DNS name, port) -> (host, container port)."""
        self.mounts: dict[str, dict[str, Path]] = {}
        """host -> mount path -> local directory."""

    def add_host(self, host: str, ports: list[int], mounts: dict[str, Path]) -> None:
        self.ports[host] = {port: free_port() for port in ports}
        self.mounts[host] = mounts

    def add_route(self, name: str, port: int, host: str, container_port: int) -> None:
        assert container_port in self.ports[host], f"{host} does not listen on {container_port}"
        self.routes[(name, port)] = (host, container_port)

    def local_port(self, host: str, port: int) -> int:
        return self.ports[host][port]

    def localize(self, text: str, host: str) -> str:
        """`text` as seen from `host`, with addresses, port flags and mount paths rewritten."""
        own = self.ports[host]

        def address(match: re.Match) -> str:
            name, port = match.group(1), int(match.group(2))
            if name in LOOPBACK and port in own:
                return f"127.0.0.1:{own[port]}"
            if (name, port) in self.routes:
                target, container_port = self.routes[(name, port)]
                return f"127.0.0.1:{self.ports[target][container_port]}"
            return match.group(0)

        def port_flag(match: re.Match) -> str:
            port = int(match.group(2))
            return f"{match.group(1)}{own[port]}" if port in own else match.group(0)

        text = _PORT_FLAG.sub(port_flag, _ADDRESS.sub(address, text))
        for mount, local in self.mounts[host].items():
            text = re.sub(rf"(?<![\w./-]){re.escape(mount)}(?=/|\b|$)", str(local), text)
        return text

    def localize_argv(self, argv: list[str], host: str) -> list[str]:
        """`localize` for each word, and a port flag's value given as the next word."""
        own = self.ports[host]
        out = []
        for i, arg in enumerate(argv):
            if i and argv[i - 1] in ("--port", "-p") and arg.isdigit() and int(arg) in own:
                out.append(str(own[int(arg)]))
            else:
                out.append(self.localize(arg, host))
        return out


@dataclass
class Running:
    container: Container
    proc: subprocess.Popen
    log: Path


class LocalStack:
    """Starts containers as processes (each in its own process group) and runs their checks."""

    def __init__(self, root: Path, network: Network):
        self.root = root
        self.network = network
        self.running: dict[str, Running] = {}
        self.events: list[str] = []
        """"start NAME" / "healthy NAME" / "completed NAME", in the order they happened."""
        self._lock = threading.Lock()

    # -- processes ---------------------------------------------------------------------------
    def host_dir(self, host: str) -> Path:
        """The host's directory: its stand-in programs (bin/), logs and fresh working dirs."""
        path = self.root / host
        if not (path / "bin").exists():
            (path / "bin").mkdir(parents=True)
            self._write_stand_ins(host, path / "bin")
        return path

    def _write_stand_ins(self, host: str, bin_dir: Path) -> None:
        redis_server = find_redis_server()
        redis_cli = shutil.which("redis-cli") or str(Path(redis_server).with_name("redis-cli"))
        default_port = self.network.ports[host].get(REDIS_DEFAULT_PORT) or free_port()
        scripts = {
            "conveyor": f'exec {shlex.quote(sys.executable)} -m services.cli "$@"\n',
            # the image's redis-server listens on 6379 of its own network namespace
            "redis-server": (
                f'case " $* " in *" --port "*) ;; *) set -- "$@" --port {default_port} ;; esac\n'
                f'exec {shlex.quote(redis_server)} "$@" --bind 127.0.0.1\n'
            ),
            "redis-cli": (
                f'case " $* " in *" -p "*) ;; *) set -- -p {default_port} "$@" ;; esac\n'
                f'exec {shlex.quote(redis_cli)} "$@"\n'
            ),
        }
        for name, body in scripts.items():
            path = bin_dir / name
            path.write_text("#!/bin/sh\n" + body)
            path.chmod(0o755)

    def environment(self, container: Container) -> dict[str, str]:
        host_dir = self.host_dir(container.host)
        env = clean_env()
        env["PATH"] = f"{host_dir / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        env["PYTHONPATH"] = str(REPO)
        env["PYTHONUNBUFFERED"] = "1"
        for name, value in container.env.items():
            env[name] = self.network.localize(value, container.host)
        return child_env(env)

    def workdir(self, container: Container) -> Path:
        mounts = self.network.mounts[container.host]
        if container.workdir in mounts:
            return mounts[container.workdir]
        path = self.host_dir(container.host) / f"{container.name.replace('/', '_')}-workdir"
        path.mkdir(exist_ok=True)
        return path

    def start(self, container: Container) -> None:
        log = self.host_dir(container.host) / f"{container.name.replace('/', '_')}.log"
        argv = self.network.localize_argv(container.argv, container.host)
        with open(log, "ab") as out:
            out.write(f"$ {shlex.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                argv,
                env=self.environment(container),
                cwd=self.workdir(container),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        with self._lock:
            self.running[container.name] = Running(container, proc, log)
            self.events.append(f"start {container.name}")

    def exit_code(self, name: str) -> int | None:
        return self.running[name].proc.poll()

    def wait_completed(self, name: str, timeout_s: float = 600.0) -> None:
        """Waits for a one-shot container; it must exit 0."""
        code = self.running[name].proc.wait(timeout=timeout_s)
        assert code == 0, f"{name} exited with {code}:\n{self.log_tail(name)}"
        self.record(f"completed {name}")

    def record(self, event: str) -> None:
        with self._lock:
            self.events.append(event)

    def assert_alive(self, names: list[str] | None = None) -> None:
        for name in names or list(self.running):
            code = self.exit_code(name)
            assert code is None, f"{name} exited with {code}:\n{self.log_tail(name)}"

    def log_tail(self, name: str, lines: int = 40) -> str:
        text = self.running[name].log.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to every process group, SIGKILL to what is left after a grace period."""
        for item in self.running.values():
            if item.proc.poll() is None:
                _signal_group(item.proc, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for item in self.running.values():
            try:
                item.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(item.proc, signal.SIGKILL)
                item.proc.wait()
            _signal_group(item.proc, signal.SIGKILL)  # children left in the group, if any

    # -- checks ------------------------------------------------------------------------------
    def run_check(self, container: Container, check: Check) -> tuple[bool, str]:
        """Runs one check from inside `container`'s host; returns (passed, what it said)."""
        if check.kind == "exec":
            argv = self.network.localize_argv(check.argv, container.host)
            try:
                done = subprocess.run(
                    argv,
                    env=self.environment(container),
                    cwd=self.workdir(container),
                    capture_output=True,
                    text=True,
                    timeout=CHECK_TIMEOUT_S,
                )
            except subprocess.TimeoutExpired:
                return False, f"{shlex.join(argv)}: timed out"
            said = f"{shlex.join(argv)} -> {done.returncode} {done.stdout}{done.stderr}".strip()
            return done.returncode == 0, said
        port = self.network.local_port(container.host, check.port)
        if check.kind == "grpc":
            status = grpc_health(f"127.0.0.1:{port}", check.service)
            return status == "SERVING", f"grpc health {check.service!r} on :{port}: {status}"
        if check.kind == "http":
            url = f"http://127.0.0.1:{port}{check.service}"
            try:
                with urllib.request.urlopen(url, timeout=CHECK_TIMEOUT_S) as response:
                    return response.status == 200, f"GET {url}: {response.status}"
            except (OSError, urllib.error.URLError) as exc:
                return False, f"GET {url}: {exc}"
        assert check.kind == "tcp", check
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                return True, f"tcp :{port} open"
        except OSError as exc:
            return False, f"tcp :{port}: {exc}"

    def wait_checks(
        self,
        container: Container,
        checks: list[Check],
        timeout_s: float = 600.0,
        while_waiting: Callable[[], None] | None = None,
    ) -> None:
        """Runs each check in turn until it passes (a startup probe before the others)."""
        deadline = time.monotonic() + timeout_s
        for check in checks:
            while True:
                self.assert_alive([container.name])
                if while_waiting is not None:
                    while_waiting()
                passed, said = self.run_check(container, check)
                if passed:
                    break
                assert time.monotonic() < deadline, (
                    f"{check.where} never passed: {said}\n{self.log_tail(container.name)}"
                )
                time.sleep(1.0)


@dataclass(frozen=True)
class Image:
    """What the manifest does not say about an image but the container gets from it."""

    entrypoint: list[str]
    ports: tuple[int, ...] = ()
    workdir: str | None = None


def dockerfile_entrypoint() -> list[str]:
    text = (REPO / "Dockerfile").read_text()
    return json.loads(re.findall(r"^ENTRYPOINT (\[.*\])$", text, re.M)[-1])


def image_of(reference: str) -> Image:
    repository = reference.rsplit("/", 1)[-1].split(":", 1)[0]
    if repository == "conveyor":
        return Image(dockerfile_entrypoint())
    # the official redis image runs a command as given, listens on 6379, works in /data
    assert repository == "redis", f"no local stand-in for the image {reference}"
    return Image([], (REDIS_DEFAULT_PORT,), "/data")


def stream(address: str, prompt: str, max_tokens: int) -> list[generation_pb2.GenerateResponse]:
    """One greedy completion of `max_tokens` streamed through the router at `address`."""
    request = generation_pb2.GenerateRequest(
        text=prompt,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return list(stub.Generate(request, timeout=300))


def grpc_health(address: str, service: str = "") -> str:
    """The gRPC health status name of `service` at `address` (or the RPC error's code)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=CHECK_TIMEOUT_S
            )
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def seed_models_volume(path: Path, model_name: str, model_dir: Path) -> Path:
    """A models volume that already holds `model_name` (a link to the locally cached model), so
    that `conveyor models fetch` in it finds the model and needs no network."""
    path.mkdir(parents=True, exist_ok=True)
    link = path / model_name
    if not link.exists():
        link.symlink_to(model_dir, target_is_directory=True)
    return path
