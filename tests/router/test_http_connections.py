"""The HTTP API against connections that hold resources without asking for anything: idle
or trickling connections, slow bodies, and requests beyond the limit. A real router process
(over the fake scheduler) with --max-concurrent-rpcs 2: 2 requests in flight, 16 connections.

Before, uvicorn's limit counted open connections: 1030 idle sockets, sent by anyone without
a key, got every authenticated request a plain-text 503, and were never closed."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request

import pytest

from services.router.api_keys import format_line, new_key
from services.router.http import app as http_app
from services.router.http.server import HEADER_TIMEOUT_S
from services.router.server import MAX_CONNECTIONS_PER_REQUEST
from tests.conftest import free_port
from tests.router.test_openai_http import get
from tests.router.utils import RouterProcess

KEY = new_key()
MAX_REQUESTS = 2
MAX_CONNECTIONS = MAX_CONNECTIONS_PER_REQUEST * MAX_REQUESTS


@pytest.fixture(scope="module")
def router(scheduler_server, tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("http-connections")
    keys = workdir / "keys.txt"
    keys.write_text(format_line(KEY, "alice", "team-a", 0) + "\n")
    port, metrics_port = free_port(), free_port()
    proc = RouterProcess(
        scheduler_server.address,
        tiny_model_dir,
        *("--http-port", str(port), "--api-key-file", str(keys)),
        *("--metrics-port", str(metrics_port), "--max-concurrent-rpcs", str(MAX_REQUESTS)),
        log=workdir / "router.log",
    ).wait_serving()
    proc.http_port = port
    proc.http = f"http://127.0.0.1:{port}"
    proc.metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    yield proc
    proc.stop()


def _complete(router) -> tuple[int, dict]:
    body = json.dumps({"prompt": "Say hi", "max_tokens": 4}).encode()
    return get(f"{router.http}/v1/completions", KEY, body)


def _open(router, first_bytes: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", router.http_port), timeout=60)
    if first_bytes:
        sock.sendall(first_bytes)
    return sock


def _is_closed_by_server(sock: socket.socket) -> bool:
    """Waits for the server to close `sock` (True), or for 60 s (False)."""
    try:
        return sock.recv(1) == b""
    except (TimeoutError, ConnectionResetError):
        return False


def test_idle_connections_keep_no_client_out(fake, router):
    idle = [_open(router) for _ in range(MAX_CONNECTIONS - 2)]
    idle.append(_open(router, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"))  # a trickle
    try:
        assert _complete(router)[0] == 200  # many more idle connections than requests allowed
    finally:
        for sock in idle:
            sock.close()


def test_a_connection_that_asks_nothing_is_closed(router):
    silent, trickling = _open(router), _open(router, b"GET /version HTTP/1.1\r\n")
    start = time.monotonic()
    assert _is_closed_by_server(silent) and _is_closed_by_server(trickling)
    assert time.monotonic() - start >= HEADER_TIMEOUT_S - 1  # not before its time
    silent.close()
    trickling.close()


def test_a_connection_over_the_cap_is_closed_at_once(fake, router):
    idle = [_open(router) for _ in range(MAX_CONNECTIONS)]
    try:
        extra = _open(router)
        assert _is_closed_by_server(extra)
        extra.close()
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.5)  # the server sees them go
    assert _complete(router)[0] == 200


def test_a_request_beyond_the_limit_gets_a_503_in_openai_shape(fake, router):
    """Two requests whose bodies trickle hold both slots: the third is refused with OpenAI's
    error body, Retry-After and a metric; /health still answers; closing them frees them."""
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n" + '{"prompt'
    holding = [_open(router, head.encode()) for _ in range(MAX_REQUESTS)]
    try:
        time.sleep(0.5)  # both heads are in
        request = urllib.request.Request(
            f"{router.http}/v1/completions",
            data=json.dumps({"prompt": "Say hi", "max_tokens": 4}).encode(),
            headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 503
        assert refused.value.headers["retry-after"] == "1"
        error = json.loads(refused.value.read())["error"]
        assert error["type"] == "service_unavailable_error" and error["code"] == "server_busy"
        assert "--max-concurrent-rpcs" in error["message"]
        assert get(f"{router.http}/health") == (200, {"status": "ok"})
    finally:
        for sock in holding:
            sock.close()
    time.sleep(0.5)
    assert _complete(router)[0] == 200
    with urllib.request.urlopen(router.metrics, timeout=30) as response:
        metrics = response.read().decode()
    assert 'conveyor:http_requests_total{endpoint="/v1/completions",status="503"}' in metrics


def test_a_body_that_does_not_arrive_in_time_gets_a_408(monkeypatch):
    """LimitBody's deadline (30 s in the router) on an ASGI call whose body stops coming."""
    monkeypatch.setattr(http_app, "BODY_TIMEOUT_S", 0.2)
    sent, seen = [], []

    async def app(scope, receive, send):
        while (message := await receive())["type"] == "http.request":
            seen.append(message)
            if not message.get("more_body"):
                return

    async def receive():
        if not seen:
            return {"type": "http.request", "body": b'{"pro', "more_body": True}
        await asyncio.sleep(3600)  # the rest never comes

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/v1/completions", "headers": [], "method": "POST"}
    asyncio.run(asyncio.wait_for(http_app.LimitBody(app, 1 << 20)(scope, receive, send), 30))
    assert sent[0]["status"] == 408
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "request_timeout" and "did not arrive" in error["message"]


def _serve_stream(monkeypatch, timeout_s: float, client) -> tuple[bool, int]:
    """A real uvicorn server (HttpServer, the router's protocol guard) whose app streams
    64 KiB chunks until the client goes; `client(port, closing)` runs in a thread and sets
    `closing` before it closes its socket. Returns whether the server let the client go
    while it was still connected, and the bytes the app sent."""
    from services.router.http import server as http_server

    monkeypatch.setattr(http_server, "WRITE_TIMEOUT_S", timeout_s)
    gone, closing = asyncio.Event(), threading.Event()
    dropped = False
    sent = 0

    async def app(scope, receive, send):
        nonlocal sent, dropped

        async def watch():
            nonlocal dropped
            while (await receive())["type"] != "http.disconnect":
                pass
            dropped = not closing.is_set()
            gone.set()

        watcher = asyncio.create_task(watch())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while not gone.is_set():
            await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
            sent += 65536
        watcher.cancel()

    async def main() -> None:
        port = free_port()
        server = http_server.HttpServer(app, "127.0.0.1", port)
        await server.start()
        try:
            await asyncio.to_thread(client, port, closing)
            await asyncio.wait_for(gone.wait(), 30)
        finally:
            await server.stop()

    asyncio.run(main())
    return dropped, sent


def test_a_client_that_takes_none_of_its_response_is_dropped(monkeypatch):
    """uvicorn waits for ever on a client that stopped reading (its host vanished): its
    request and its slot were held until TCP gave up, ~15 minutes later."""

    def stalled(port: int, closing: threading.Event) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(10)  # reads nothing; the server drops it after 1 s of paused writes
        closing.set()
        sock.close()

    dropped, _ = _serve_stream(monkeypatch, 1.0, stalled)
    assert dropped


def test_a_client_that_reads_slowly_keeps_its_connection(monkeypatch):
    def slow(port: int, closing: threading.Event) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            received = 0
            while received < 8 << 20:
                chunk = sock.recv(1 << 20)
                assert chunk, "the server dropped a client that reads"
                received += len(chunk)
                time.sleep(0.01)
            closing.set()

    dropped, sent = _serve_stream(monkeypatch, 5.0, slow)
    assert not dropped and sent >= 8 << 20
