"""`conveyor models ...`: fetch known models, write tiny random ones, list the cache.

    conveyor models fetch smollm2-135m [--dir CACHE_DIR] [--no-progress]
    conveyor models make-tiny DIR [--layers N] [--hidden-size N] [--heads N] [--kv-heads N]
                                  [--vocab-size N] [--untied] [--seed N]
    conveyor models list [--dir CACHE_DIR]

`fetch` and `make-tiny` print the model directory as their last line of stdout, so that
scripts can do `MODEL=$(conveyor models fetch smollm2-135m | tail -n1)`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the `models` sub-subcommands (no heavy imports here)."""
    sub = parser.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    fetch = sub.add_parser("fetch", help="download and convert a known model (cached)")
    fetch.add_argument(
        "name", nargs="?", default="smollm2-135m", help="model name (default: smollm2-135m)"
    )
    fetch.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="cache root; the model goes to DIR/NAME "
        "(default: $CONVEYOR_CACHE_DIR or ~/.cache/conveyor/models)",
    )
    fetch.add_argument("--no-progress", action="store_true", help="no progress bars")

    tiny = sub.add_parser("make-tiny", help="write a tiny random Llama model for tests")
    tiny.add_argument("dir", type=Path, help="directory to write (created)")
    tiny.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    tiny.add_argument("--hidden-size", type=int, default=64, help="hidden size (default: 64)")
    tiny.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    tiny.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default: 2)")
    tiny.add_argument("--vocab-size", type=int, default=512, help="embedding rows (default: 512)")
    tiny.add_argument("--untied", action="store_true", help="separate lm_head weights")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")

    listing = sub.add_parser("list", help="known models and whether they are cached")
    listing.add_argument("--dir", type=Path, default=None, help="cache root (as for fetch)")


def run(args: argparse.Namespace) -> int:
    """Run one `models` action; errors are printed as one line and exit 2 (a bad value or
    path) or 1 (anything else, e.g. a failed download)."""
    from services.common.errors import ConfigError, ConveyorError

    try:
        if args.models_command == "fetch":
            return _fetch(args)
        if args.models_command == "make-tiny":
            return _make_tiny(args)
        return _list(args)
    except ConfigError as exc:
        print(f"conveyor models {args.models_command}: error: {exc}", file=sys.stderr)
        return 2
    except ConveyorError as exc:
        print(f"conveyor models {args.models_command}: {exc}", file=sys.stderr)
        return 1


def _fetch(args: argparse.Namespace) -> int:
    from services.models.fetch import fetch_model

    path = fetch_model(args.name, cache_dir=args.dir, progress=not args.no_progress)
    print(path)
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from services.models.tiny import make_tiny_model

    path = make_tiny_model(
        args.dir,
        num_layers=args.layers,
        hidden_size=args.hidden_size,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        vocab_size=args.vocab_size,
        tie_word_embeddings=not args.untied,
        seed=args.seed,
    )
    print(path)
    return 0


def _list(args: argparse.Namespace) -> int:
    from services.models.fetch import KNOWN_MODELS, is_complete, model_path

    for name, spec in sorted(KNOWN_MODELS.items()):
        path = model_path(name, args.dir)
        state = f"cached at {path}" if is_complete(path) else "not cached"
        print(f"{name}\t{state}\t{spec.description}")
    return 0
