"""`free_port`: a port is handed out once per process, even when the OS offers it again."""

from __future__ import annotations

import socket

from services.common import redis_server
from services.common.redis_server import free_port


class _OfferedPorts:
    """A socket whose bind to port 0 gets the next of `ports` (what the OS would offer)."""

    def __init__(self, ports: list[int]):
        self.ports = ports

    def __call__(self, *args, **kwargs):
        offered = self

        class Sock:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def bind(self, address):
                self.port = offered.ports.pop(0)

            def getsockname(self):
                return ("127.0.0.1", self.port)

        return Sock()


def test_a_port_offered_again_is_not_handed_out_twice(monkeypatch):
    monkeypatch.setattr(redis_server, "_handed_out", set())
    monkeypatch.setattr(redis_server.socket, "socket", _OfferedPorts([41000, 41000, 41000, 41001]))
    assert [free_port(), free_port()] == [41000, 41001]


def test_real_ports_are_distinct_and_bindable():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))


def test_a_port_the_command_line_names_is_never_handed_out(monkeypatch):
    """The router binds its --port only after the workers got theirs: the OS still offers
    it meanwhile (a CI run once gave stage 0 the router's port)."""
    import argparse

    from services.common.redis_server import reserve_ports
    from services.launcher import _named_ports

    monkeypatch.setattr(redis_server, "_handed_out", set())
    args = argparse.Namespace(
        port=41000,
        http_port=41001,
        scheduler_port=41010,
        pipelines=2,
        stages=2,
        tensor_parallel_size=1,
        metrics_port=None,
        no_http=False,
        tls_client_ca=None,
        api_key_file=None,
    )
    assert _named_ports(args) == [41000, 41001, 41010, 41011]
    reserve_ports(_named_ports(args))
    offered = _OfferedPorts([41000, 41001, 41010, 41011, 41002])
    monkeypatch.setattr(redis_server.socket, "socket", offered)
    assert free_port() == 41002


def test_ports_come_from_below_the_ephemeral_range(monkeypatch, tmp_path):
    """Outgoing connections take ports from the ephemeral range: a port handed out from it
    could be taken by one before the child binds it (CI once saw the router's --http-port
    in use)."""
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    monkeypatch.setattr(redis_server, "EPHEMERAL_PORTS_FILE", str(ranges))
    ports = [free_port() for _ in range(20)]
    assert all(redis_server.LOWEST_PORT <= p < 32768 for p in ports), ports
    ranges.write_text("1024 65535\n")  # nothing below the range: whatever the OS offers
    assert free_port() > 0


def test_a_port_in_use_is_passed_over(monkeypatch, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        picks = iter([taken, free])
        monkeypatch.setattr(redis_server._random, "choice", lambda _ports: next(picks))
        monkeypatch.setattr(redis_server, "_handed_out", set())
        assert free_port() == free
