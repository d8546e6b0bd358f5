"""HTTP/2 keepalive pings on every Conveyor gRPC connection, both ways, and how soon a
channel reconnects to a server that went away.

Without them a peer that vanishes without closing its connection (a host that lost power
or its network, a process stopped with SIGSTOP, a paused VM) is never noticed: a server
kept serving a client that was gone (its request, its stream slot), and a client waited on
a server that would never answer until its own deadline, or for ever without one. With
them each side pings the other every `PING_INTERVAL_S` while the connection is up, and
drops it when a ping goes unanswered for `PING_TIMEOUT_S`: the server's calls on it are
cancelled (a router aborts the request), the client's fail UNAVAILABLE (and are retried
where the caller retries). See grpc's doc/keepalive.md for the channel arguments.

A channel whose server is gone tries again after a backoff that grows (grpc's default:
1 s, times 1.6 per failure, up to 120 s), and fails every call meanwhile without trying.
After a scheduler was down for 30 s its router took 11 to 15 s more to see it back, and
refused requests all that time; `RECONNECT_MAX_S` caps the backoff (grpc's
doc/connection-backoff.md). A server that comes back at another address (a Kubernetes pod
restarted behind a headless Service, as the stage workers are) is found when the channel
resolves its name again, which grpc does at most every 30 s by default: a channel reached a
restarted server's new address 27 s after it served. `RECONNECT_MAX_S` bounds that too.
"""

from __future__ import annotations

PING_INTERVAL_S = 30.0
"""How often each side pings the other (idle or not)."""
PING_TIMEOUT_S = 20.0
"""How long a ping may go unanswered before the connection is dropped."""
MIN_CLIENT_PING_INTERVAL_S = 10.0
"""Servers accept client pings this often (grpc's default, 5 minutes, would answer
Conveyor's own clients' pings with GOAWAY "too_many_pings")."""
RECONNECT_MAX_S = 1.0
"""The longest a channel waits before it tries a server that went away again, and before it
resolves the server's name again."""


def channel_options(
    interval_s: float = PING_INTERVAL_S, timeout_s: float = PING_TIMEOUT_S
) -> list[tuple[str, int]]:
    """grpc channel options: ping the server (no more often than servers accept), and try
    a server that went away at least every RECONNECT_MAX_S."""
    return [
        *_pings(interval_s, timeout_s),
        ("grpc.max_reconnect_backoff_ms", int(RECONNECT_MAX_S * 1000)),
        ("grpc.dns_min_time_between_resolutions_ms", int(RECONNECT_MAX_S * 1000)),
    ]


def _pings(interval_s: float, timeout_s: float) -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", int(interval_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
        ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),  # grpc 1.6x+: what times out
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # a quiet stream is pinged too
    ]


def server_options(
    interval_s: float = PING_INTERVAL_S, timeout_s: float = PING_TIMEOUT_S
) -> list[tuple[str, int]]:
    """grpc server options: ping clients as a channel pings its server, and accept their
    pings every MIN_CLIENT_PING_INTERVAL_S."""
    accept = int(MIN_CLIENT_PING_INTERVAL_S * 1000)
    return [
        *_pings(interval_s, timeout_s),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", accept),
    ]
