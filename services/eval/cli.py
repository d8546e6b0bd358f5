"""`conveyor eval ...`: quality of a model as the workers load it, in one process.

    conveyor eval ppl --model DIR [--dtype D] [--quantization Q] [--window 512] [--num-windows 32]
    conveyor eval greedy --model DIR --quantization Q [--dtype D] [--reference-dtype D]
                         [--num-tokens 32]

`ppl` prints the perplexity on Python's own documentation prose (`pydoc_data.topics`);
`greedy` decodes a fixed prompt set with and without quantization and prints how many
tokens agree. Both load the model through the worker's own path (`StageRunner.from_config`:
same quantization, kernels and threads as `conveyor worker`).
"""

from __future__ import annotations

import argparse

from services.worker.config import DEVICES, DTYPES, QUANTIZATIONS, parse_projections


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval_command", required=True, metavar="ACTION")
    ppl = sub.add_parser("ppl", help="perplexity on pydoc_data.topics (ships with Python)")
    _model_arguments(ppl)
    ppl.add_argument("--window", type=int, default=512, help="tokens per window (default: 512)")
    ppl.add_argument("--num-windows", type=int, default=32, help="windows scored (default: 32)")
    greedy = sub.add_parser(
        "greedy", help="greedy agreement with the unquantized model on a fixed prompt set"
    )
    _model_arguments(greedy)
    greedy.add_argument(
        "--reference-dtype",
        choices=list(DTYPES),
        default=None,
        help="dtype of the unquantized reference (default: --dtype)",
    )
    greedy.add_argument(
        "--num-tokens", type=int, default=32, help="tokens per prompt (default: 32)"
    )


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument(
        "--quantization", choices=list(QUANTIZATIONS), default=None, help="as the worker's"
    )
    parser.add_argument(
        "--quantization-ignore",
        default=None,
        metavar="PROJ[,PROJ]",
        help="as the worker's (default: down_proj for fp8, none for int8)",
    )
    parser.add_argument("--device", choices=[d for d in DEVICES if d != "sim"], default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="default: this machine's cores")


def _runner(args, dtype: str, quantization: str | None, max_model_len: int):
    from services.worker.config import WorkerConfig
    from services.worker.runner import StageRunner

    config = WorkerConfig(
        args.model,
        dtype=dtype,
        quantization=quantization,
        quantization_ignore=parse_projections(args.quantization_ignore),
        device=args.device,
        num_threads=args.threads,
        max_model_len=max_model_len,
        kv_cache_memory="1GiB",
    )
    return StageRunner.from_config(config)


def _tokenizer(model_dir: str):
    from pathlib import Path

    from tokenizers import Tokenizer

    from services.common.errors import ConfigError

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir} has no tokenizer.json: eval needs the model's tokenizer")
    return Tokenizer.from_file(str(path))


def run(args: argparse.Namespace) -> int:
    from services.common.errors import ConfigError

    if args.eval_command == "ppl":
        if args.window < 2 or args.num_windows < 1:
            raise ConfigError("--window must be >= 2 and --num-windows >= 1")
        return _run_ppl(args)
    if args.num_tokens < 1:
        raise ConfigError(f"--num-tokens={args.num_tokens} must be >= 1")
    return _run_greedy(args)


def _label(args, dtype: str, quantization: str | None) -> str:
    ignore = f" quantization-ignore={args.quantization_ignore}" if args.quantization_ignore else ""
    return f"dtype={dtype} quantization={quantization or 'none'}{ignore}"


def _run_ppl(args) -> int:
    from services.common.errors import ConfigError, ModelLoadError
    from services.eval.quality import corpus_text, make_windows, perplexity
    from services.worker.model.config import ModelConfig

    try:
        model_max = ModelConfig.from_dir(args.model).max_position_embeddings
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from exc
    if args.window > model_max:  # a window is one sequence: the worker's rule, in eval's terms
        raise ConfigError(
            f"--window={args.window} exceeds the model's max_position_embeddings={model_max}: "
            f"lower --window"
        )
    token_ids = _tokenizer(args.model).encode(corpus_text()).ids
    windows = make_windows(token_ids, args.window, args.num_windows)
    if len(windows) < args.num_windows:
        raise ConfigError(
            f"the corpus has {len(token_ids)} tokens: {args.num_windows} windows of "
            f"{args.window} do not fit; lower --num-windows or --window"
        )
    runner = _runner(args, args.dtype, args.quantization, args.window)
    result = perplexity(runner, windows)
    print(
        f"{_label(args, args.dtype, args.quantization)} perplexity={result.value:.4f} "
        f"tokens={result.num_tokens} seconds={result.seconds:.1f}"
    )
    return 0


def _run_greedy(args) -> int:
    from services.eval.quality import PROMPTS, agreement, greedy

    tokenizer = _tokenizer(args.model)
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    max_len = max(map(len, prompts)) + args.num_tokens
    reference_dtype = args.reference_dtype or args.dtype
    reference = greedy(_runner(args, reference_dtype, None, max_len), prompts, args.num_tokens)
    ours = greedy(_runner(args, args.dtype, args.quantization, max_len), prompts, args.num_tokens)
    result = agreement(ours, reference)
    print(
        f"{_label(args, args.dtype, args.quantization)} vs dtype={reference_dtype} "
        f"quantization=none: identical={result.num_identical}/{result.num_prompts} "
        f"prefix={result.prefix_fraction:.3f} tokens={result.token_fraction:.3f}"
    )
    return 0
