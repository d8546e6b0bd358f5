"""`conveyor health ADDR`: ask a Conveyor service for its standard gRPC health status.

Container healthchecks (docker compose) use it: the exit status is 0 when the service answers
SERVING, 1 otherwise (NOT_SERVING, unknown service, unreachable, timeout). It prints the status,
so a person running it by hand sees why.
"""

from __future__ import annotations

import argparse
import os

DEFAULT_TIMEOUT_S = 5.0


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
        help="seconds to wait for the answer (env CONVEYOR_HEALTH_TIMEOUT, default: 5)",
    )


def run(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if args.timeout <= 0:
        print(f"--timeout must be > 0 seconds, got {args.timeout}")
        return 1
    request = health_pb2.HealthCheckRequest(service=args.service)
    try:
        with grpc.insecure_channel(args.address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout)
    except grpc.RpcError as exc:
        # NOT_FOUND: the server does not know this service name; UNAVAILABLE: nothing listening.
        print(f"{args.address}: {exc.code().name}: {exc.details()}")
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(status)
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1
