"""`conveyor health ADDR`: ask a Conveyor service for its standard gRPC health status.

Container healthchecks (docker compose) use it: the exit status is 0 when the service answers
SERVING, 1 otherwise (NOT_SERVING, unknown service, unreachable, timeout), and 2 for a bad flag
or file (a --tls-ca that holds no certificate), so a misconfigured probe does not read as a dead
service. It prints the status, so a person running it by hand sees why. With `--wait SECONDS`
it keeps asking until the service is SERVING or SECONDS have passed, so a script can wait for
a stack that is starting.
"""

from __future__ import annotations

import argparse
import os
import time

from services.common.security import ClientSecurity, add_tls_arguments

DEFAULT_TIMEOUT_S = 5.0
POLL_INTERVAL_S = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="HOST:PORT of the service's gRPC port")
    parser.add_argument(
        "--service",
        default="",
        help="health service name to check (default: '' = the whole server)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=float(os.environ.get("CONVEYOR_HEALTH_TIMEOUT", DEFAULT_TIMEOUT_S)),
        help="seconds to wait for each answer (env CONVEYOR_HEALTH_TIMEOUT, default: 5)",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep asking until SERVING or SECONDS have passed (default: 0 = ask once)",
    )
    add_tls_arguments(
        parser,
        cert_help="client certificate, for a service with mutual TLS (health asks for no "
        "other credential)",
        ca_help="PEM CA the service's certificate chains to: TLS on",
        environ=os.environ,
    )


def check_once(
    address: str, service: str, timeout_s: float, security: ClientSecurity | None = None
) -> tuple[bool, str]:
    """One health check on a fresh channel (over TLS with `security`): (is SERVING, what to
    print).

    A fresh channel per check: a channel that failed to connect backs off exponentially, which
    would delay seeing a server that came up meanwhile."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    request = health_pb2.HealthCheckRequest(service=service)
    try:
        with (security or ClientSecurity()).sync_channel(address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        # NOT_FOUND: the server does not know this service name; UNAVAILABLE: nothing listening.
        return False, f"{address}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return response.status == health_pb2.HealthCheckResponse.SERVING, status


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        print(f"--timeout must be > 0 seconds, got {args.timeout}")
        return 1
    if args.wait < 0:
        print(f"--wait must be >= 0 seconds, got {args.wait}")
        return 1
    security = ClientSecurity.from_files(args.tls_ca, args.tls_cert, args.tls_key)
    deadline = time.monotonic() + args.wait
    while True:
        is_serving, message = check_once(args.address, args.service, args.timeout, security)
        if is_serving or time.monotonic() + POLL_INTERVAL_S > deadline:
            break
        time.sleep(POLL_INTERVAL_S)
    print(message)
    return 0 if is_serving else 1
