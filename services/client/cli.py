"""`conveyor generate`: stream a completion from a running router to the terminal."""

from __future__ import annotations

import argparse
import json
import os
import sys

from services.common.errors import InvalidRequest
from services.common.sampling import SamplingParams
from services.common.security import ENV_API_KEY, add_tls_arguments

SAMPLING_KWARGS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")
"""The request keywords the router validates as SamplingParams."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        default="localhost:50051",
        help="router address HOST:PORT (default: localhost:50051)",
    )
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="plain-text prompt")
    prompt.add_argument("--chat", help="a user message, sent through the chat template")
    parser.add_argument("--system", default=None, help="system message for --chat")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: 16")
    parser.add_argument("--temperature", type=float, default=None, help="default: 0 (greedy)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--model", default=None, help="model name (default: the served one)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, token_ids, finish_reason, usage)",
    )
    add_tls_arguments(
        parser,
        cert_help="client certificate, for a router with --tls-client-ca",
        ca_help=f"PEM CA the router's certificate chains to: TLS on. The API key, if the "
        f"router asks for one, comes from env {ENV_API_KEY}",
        environ=os.environ,
    )


def _request_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos or None,
        "model": args.model,
    }
    if args.chat is not None:
        chat = [{"role": "system", "content": args.system}] if args.system else []
        kwargs["chat"] = [*chat, {"role": "user", "content": args.chat}]
    else:
        if args.system:
            raise SystemExit("--system needs --chat")
        kwargs["prompt"] = args.prompt
    return kwargs


def check_sampling(kwargs: dict) -> None:
    """Raises InvalidRequest, with the router's own message, for sampling flags out of the
    range the router accepts: some (--seed -1, --max-tokens 5000000000) do not even fit the
    request's fields, others (--max-tokens 0) would arrive as "unset" and mean the default."""
    SamplingParams(**{k: v for k, v in kwargs.items() if k in SAMPLING_KWARGS and v is not None})


def run(args: argparse.Namespace) -> int:
    import grpc

    from services.client.client import ConveyorClient, collect

    kwargs = _request_kwargs(args)
    try:
        check_sampling(kwargs)
    except InvalidRequest as exc:  # as the router would answer it (docs/api.md)
        print(f"error: INVALID_ARGUMENT: {exc}", file=sys.stderr)
        return 2
    try:
        client = ConveyorClient(
            args.server,
            timeout_s=args.timeout,
            api_key=os.environ.get(ENV_API_KEY) or None,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )
        with client:
            deltas = client.generate(**kwargs)
            if args.json:
                print(json.dumps(collect(deltas).to_dict(), ensure_ascii=False))
                return 0
            last = None
            try:
                for delta in deltas:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                    last = delta
            finally:  # the text streamed so far ends its line, before any error
                sys.stdout.write("\n")
                sys.stdout.flush()
            if last is not None and last.usage:
                print(
                    f"[{last.finish_reason}; {last.usage['prompt_tokens']} prompt + "
                    f"{last.usage['completion_tokens']} generated tokens]",
                    file=sys.stderr,
                )
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    return 0
