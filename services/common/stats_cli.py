"""`conveyor stats --server ADDR`: the KV memory monitor (the seed's memory monitor).

Asks the scheduler for `GetStats` and prints block usage, free and cached blocks,
fragmentation, prefix-cache hit rate, queue sizes, the bubble of every stage and the
requests holding the most blocks. `--json` prints the same numbers as one JSON object;
`--watch [SECONDS]` prints them again every SECONDS (default 2) until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from services.common.config import checked
from services.common.credentials import internal_token
from services.common.security import ClientSecurity, add_internal_token_argument, add_tls_arguments

DEFAULT_WATCH_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", required=True, help="the scheduler's gRPC address HOST:PORT")
    parser.add_argument("--json", action="store_true", help="print one JSON object per sample")
    parser.add_argument(
        "--watch",
        type=checked(float, lambda s: s > 0, "> 0"),
        nargs="?",
        const=DEFAULT_WATCH_S,
        default=None,
        metavar="SECONDS",
        help=f"refresh every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C",
    )
    parser.add_argument(
        "--top", type=int, default=10, help="requests listed by blocks held (default: 10)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds to wait for the scheduler (default: 10)",
    )
    add_tls_arguments(
        parser,
        cert_help="client certificate, for a scheduler with mutual TLS",
        ca_help="PEM CA the scheduler's certificate chains to: TLS on",
        environ=os.environ,
    )
    add_internal_token_argument(parser, "file holding the scheduler's internal token")


def stats_to_dict(msg, top: int) -> dict:
    """The numbers of a SchedulerStats message, with the `top` requests by blocks held."""
    blocks = sorted(msg.request_blocks.items(), key=lambda kv: (-kv[1], kv[0]))
    return {
        "serving": msg.serving,
        "not_serving_reason": msg.not_serving_reason,
        "scheduling": msg.scheduling,
        "num_stages": msg.num_stages,
        "num_waiting": msg.num_waiting,
        "num_running": msg.num_running,
        "num_inflight": msg.num_inflight,
        "max_inflight": msg.max_inflight,
        "async_lead": msg.async_lead,
        "async_lead_changes": msg.async_lead_changes,
        "num_preempted_total": msg.num_preempted_total,
        "num_steps": msg.num_steps,
        "mean_schedule_us": msg.mean_schedule_us,
        "block_size": msg.block_size,
        "num_blocks": msg.num_blocks,
        "num_used_blocks": msg.num_blocks - msg.num_free_blocks,
        "num_free_blocks": msg.num_free_blocks,
        "num_cached_blocks": msg.num_cached_blocks,
        "kv_usage": msg.kv_usage,
        "fragmentation": msg.fragmentation,
        "prefix_cache_hit_rate": msg.prefix_cache_hit_rate,
        "bubble_fraction": list(msg.bubble_fraction),
        "plan_wait_fraction": list(msg.plan_wait_fraction),
        "speculative_config": msg.speculative_config,
        "num_spec_steps": msg.num_spec_steps,
        "num_spec_draft_tokens": msg.num_spec_draft_tokens,
        "num_spec_accepted_tokens": msg.num_spec_accepted_tokens,
        "spec_acceptance_rate": msg.spec_acceptance_rate,
        "spec_mean_accepted_length": msg.spec_mean_accepted_length,
        "num_draft_calls": msg.num_draft_calls,
        "num_draft_failures": msg.num_draft_failures,
        "draft_problem": msg.draft_problem,
        "num_requests_with_blocks": len(blocks),
        "top_requests": [{"request_id": rid, "num_blocks": n} for rid, n in blocks[:top]],
    }


def _speculation(stats: dict) -> str:
    if not stats["speculative_config"]:
        return "off"
    line = (
        f"{stats['spec_acceptance_rate']:.1%} of {stats['num_spec_draft_tokens']} proposed "
        f"tokens accepted, {stats['spec_mean_accepted_length']:.2f} tokens per speculative "
        f"step ({stats['num_spec_steps']} steps)"
    )
    if stats["num_draft_calls"] or stats["num_draft_failures"]:
        line += (
            f"; draft worker: {stats['num_draft_calls']} calls, "
            f"{stats['num_draft_failures']} failed"
        )
    if stats["draft_problem"]:
        line += f"; now: {stats['draft_problem']}"
    return line


def _window(stats: dict) -> str:
    """The steps the scheduler keeps in flight at most, and why that many."""
    if not stats["max_inflight"]:
        return "n/a (the scheduler has not started its pipeline)"
    most = f"{stats['max_inflight']} steps in flight at most"
    if stats["async_lead"]:
        changes = stats["async_lead_changes"]
        return (
            f"{most} (P + {stats['async_lead']}: the lead adapts to stage 0's plan waits, "
            f"changed {changes} time{'s' if changes != 1 else ''})"
        )
    if stats["scheduling"] == "async":
        return f"{most} (--max-inflight)"
    return most


def format_table(stats: dict) -> str:
    """A plain-text table of `stats_to_dict`'s numbers."""
    bubbles = "  ".join(f"stage {i}: {b:.1%}" for i, b in enumerate(stats["bubble_fraction"]))
    plan_waits = "  ".join(f"stage {i}: {w:.1%}" for i, w in enumerate(stats["plan_wait_fraction"]))
    rows = [
        (
            "serving",
            f"{'yes' if stats['serving'] else 'no: ' + stats['not_serving_reason']} "
            f"({stats['scheduling']}, {stats['num_stages']} stages)",
        ),
        (
            "requests",
            f"{stats['num_running']} running, {stats['num_waiting']} waiting, "
            f"{stats['num_preempted_total']} preemptions so far",
        ),
        (
            "steps",
            f"{stats['num_steps']} planned, {stats['num_inflight']} in flight, "
            f"{stats['mean_schedule_us']:.0f} us to plan one",
        ),
        ("window", _window(stats)),
        (
            "KV blocks",
            f"{stats['num_used_blocks']} / {stats['num_blocks']} used "
            f"({stats['kv_usage']:.1%}), {stats['block_size']} tokens each",
        ),
        (
            "free blocks",
            f"{stats['num_free_blocks']} (of which {stats['num_cached_blocks']} "
            "hold cached prefixes)",
        ),
        ("fragmentation", f"{stats['fragmentation']:.1%} of allocated slots empty"),
        ("prefix hit rate", f"{stats['prefix_cache_hit_rate']:.1%} of prompt tokens"),
        ("bubble", bubbles or "n/a"),
        ("plan wait", plan_waits or "n/a"),
        ("speculation", _speculation(stats)),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    if stats["top_requests"]:
        shown, total = len(stats["top_requests"]), stats["num_requests_with_blocks"]
        lines += ["", f"{'request':<40} {'blocks':>8}   (top {shown} of {total})"]
        lines += [f"{r['request_id']:<40} {r['num_blocks']:>8}" for r in stats["top_requests"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import grpc

    from services.common.proto.conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc

    token = internal_token(args.internal_token_file, os.environ)
    security = ClientSecurity.from_files(args.tls_ca, args.tls_cert, args.tls_key, token)
    with security.sync_channel(args.server) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        try:
            while True:
                try:
                    msg = stub.GetStats(
                        scheduler_pb2.GetStatsRequest(),
                        timeout=args.timeout,
                        metadata=security.with_metadata(None),
                    )
                except grpc.RpcError as exc:
                    print(f"{args.server}: {exc.code().name}: {exc.details()}")
                    return 1
                stats = stats_to_dict(msg, args.top)
                if args.json:
                    print(json.dumps(stats), flush=True)
                else:
                    if args.watch is not None and sys.stdout.isatty():
                        print("\033[2J\033[H", end="")  # clear the terminal
                    print(format_table(stats), flush=True)
                if args.watch is None:
                    return 0
                time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
