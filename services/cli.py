"""The `conveyor` command line: one subcommand per service or tool.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
heavy imports (torch, grpc) happen inside `run`, so `conveyor --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from services.common.errors import ConfigError
from services.common.logs import setup_logging
from services.common.process import die_with_parent

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "models": ("services.models.cli", "fetch the test model or write a tiny random one"),
    "worker": ("services.worker.cli", "run one pipeline stage (a slice of the model's layers)"),
    "scheduler": ("services.scheduler.cli", "plan steps and drive the pipeline's stage workers"),
    "router": ("services.router.cli", "serve the public Generation and KServe v2 gRPC APIs"),
    "generate": ("services.client.cli", "stream a completion from a running router"),
    "up": ("services.launcher", "start the whole stack on this machine"),
    "health": ("services.common.health_cli", "check a Conveyor service's gRPC health"),
    "stats": ("services.common.stats_cli", "KV memory monitor: block usage, queues, bubble"),
    "bench": ("services.bench.cli", "benchmark a running stack, or --compare scheduling modes"),
    "eval": ("services.eval.cli", "quality: perplexity and greedy agreement of (quantized) models"),
    "keys": ("services.router.api_keys", "make API keys for the router's --api-key-file"),
    "certs": ("services.common.certs", "make development certificates for TLS between services"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor",
        description="LLM serving with pipeline parallelism and asynchronous scheduling.",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        cmd_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(cmd_parser)
        cmd_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # no-op unless started by `conveyor up` (or the tests) as a child
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, json_lines=args.log_json)
    try:
        return int(args._module.run(args) or 0)
    except ConfigError as exc:  # a bad flag or value: say which, no traceback
        print(f"conveyor {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `conveyor stats --watch | head`: the reader is gone, so are we
        # Python flushes stdout again at exit: point it at /dev/null so that raises nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
