"""`make demo`: fetch SmolLM2-135M, start a 2-stage stack, stream one answer, stop the stack.

Run as `python -m services.demo [--model DIR] [--chat TEXT] [--max-tokens N]`; exits 0 when an answer was
streamed and the stack stopped cleanly.
"""

from __future__ import annotations

import argparse
import sys
import time

from services.common.logs import setup_logging
from services.common.redis_server import free_port
from services.launcher import add_arguments as add_up_arguments
from services.launcher import start_stack

DEFAULT_CHAT = "In two sentences, what is pipeline parallelism?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.demo", description=__doc__)
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M)")
    parser.add_argument("--chat", default=DEFAULT_CHAT, help="the question to ask")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    setup_logging("WARNING")

    from services.client.client import ConveyorClient
    from services.models.fetch import fetch_model

    model = args.model or str(fetch_model("smollm2-135m", progress=True))
    up = argparse.ArgumentParser()
    add_up_arguments(up)
    up_args = up.parse_args(
        [
            "--model",
            model,
            "--stages",
            "2",
            "--port",
            str(free_port()),
            "--kv-cache-memory",
            "512MiB",
            "--no-http",
        ]
    )
    print(f"starting Conveyor: {model}, 2 pipeline stages, async scheduling ...", flush=True)
    t0 = time.monotonic()
    stack, address = start_stack(up_args)
    try:
        print(f"serving on {address} after {time.monotonic() - t0:.0f} s\n", flush=True)
        print(f"> {args.chat}\n", flush=True)
        num_tokens, finish = 0, None
        with ConveyorClient(address, timeout_s=300) as client:
            for delta in client.generate(
                chat=[{"role": "user", "content": args.chat}], max_tokens=args.max_tokens
            ):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                num_tokens += len(delta.token_ids)
                finish = delta.finish_reason or finish
        print(f"\n\n[{num_tokens} tokens, finish reason: {finish}]", flush=True)
    finally:
        stack.stop()
    print("stack stopped", flush=True)
    return 0 if num_tokens > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
