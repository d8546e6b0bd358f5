"""Quantized weights against full precision, on this machine, in one run (issue 22).

    python -m services.bench.quant_compare [--model DIR] [--num-prompts 64 --input-len 32
        --output-len 32] [--stages 1 --threads 2] [--window 256 --num-windows 12]
        [--decode-only | --quality-only]

Decode steps first: the worker's own `StageRunner.execute` of one decode step, for 1 and
`--num-prompts` requests, in fp32, bf16 and int8 taking turns round by round in this
process (`--decode-only` stops there). Then, for each weight format (`--dtype float32`,
`bfloat16`, `bfloat16 --quantization int8`) it starts `conveyor up`, runs a warm-up, one
request alone (its TPOT) and the burst (`--num-prompts` requests all at once), like
`conveyor bench --compare`. Quality, in this
process with the stacks stopped (`--quality-only`: that alone): perplexity on
pydoc_data.topics (`conveyor eval ppl`) in fp32, bf16, int8, fp8 (down_proj kept in bf16,
the default) and fp8-all (`--quantization-ignore none`), and greedy agreement of int8 and
fp8 with the unquantized model (`conveyor eval greedy`). Prints one table of ratios and
writes quant.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from services.bench.compare import _bench_mode
from services.bench.driver import DriverOptions
from services.bench.run import Workload, build_requests
from services.bench.stack import Mode, start_stack

SPEED = {  # key -> worker flags
    "fp32": ["--dtype", "float32"],
    "bf16": ["--dtype", "bfloat16"],
    "int8": ["--dtype", "bfloat16", "--quantization", "int8"],
}
QUALITY = {  # key -> (dtype, quantization, --quantization-ignore)
    "fp32": ("float32", None, None),
    "bf16": ("bfloat16", None, None),
    "int8": ("bfloat16", "int8", None),
    "fp8": ("bfloat16", "fp8", None),  # down_proj kept in bf16 (the default)
    "fp8-all": ("bfloat16", "fp8", "none"),  # every projection in FP8: the format before
}


def run_speed(args, results_dir: Path) -> dict[str, dict]:
    workload = Workload(
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len
    )
    options = DriverOptions(progress=False, ignore_eos=True)
    results, requests = {}, None
    for key, flags in SPEED.items():
        mode = Mode(key, key, stages=args.stages, scheduling="async", threads=args.threads)
        stack = start_stack(args.model, mode, results_dir, extra_args=flags)
        try:
            requests = requests or asyncio.run(build_requests(stack.router, workload))
            print(f"--- {key}: {len(requests)} requests", flush=True)
            results[key] = asyncio.run(_bench_mode(stack, requests, options, workload.seed))
        finally:
            stack.stop()
    return results


def run_decode(args, num_rounds: int = 5, num_steps: int = 4) -> dict[str, dict]:
    """Median decode-step time of the worker's forward + sampling (`StageRunner.execute`),
    for 1 and `--num-prompts` requests at context ~`--input-len`. The formats take turns,
    round by round, so that the outside load drifts over all of them alike."""
    import statistics
    import time

    from services.common.sampling import SamplingParams
    from services.common.step import CachedRequest, NewRequest, StepPlan
    from services.eval.cli import _runner

    max_len = args.input_len + num_rounds * num_steps + 1
    runners = {key: _runner(_namespace(args, key), *QUALITY[key][:2], max_len) for key in SPEED}
    results: dict[str, dict] = {key: {} for key in SPEED}
    for batch in (1, args.num_prompts):
        ids = [f"r{i}" for i in range(batch)]
        for runner in runners.values():  # prefill each request, not timed
            blocks = -(-max_len // runner.kv_cache.block_size)
            new = [
                NewRequest(
                    rid,
                    [100 + i] * args.input_len,
                    args.input_len,
                    SamplingParams(max_tokens=max_len, temperature=0.0),
                    list(range(i * blocks, (i + 1) * blocks)),
                    0,
                    args.input_len,
                )
                for i, rid in enumerate(ids)
            ]
            runner.execute(StepPlan(0, new_requests=new))
        times: dict[str, list[float]] = {key: [] for key in runners}
        for _ in range(num_rounds):
            for key, runner in runners.items():
                for _ in range(num_steps):
                    start = time.perf_counter()
                    runner.execute(StepPlan(1, cached_requests=[CachedRequest(r, 1) for r in ids]))
                    times[key].append(time.perf_counter() - start)
        for key, runner in runners.items():
            runner.execute(StepPlan(2, finished_request_ids=ids))
            results[key][f"decode_ms_batch{batch}"] = statistics.median(times[key]) * 1e3
            print(
                f"--- {key}: decode step, {batch} requests: "
                f"{results[key][f'decode_ms_batch{batch}']:.1f} ms",
                flush=True,
            )
    return results


def _namespace(args, key: str) -> argparse.Namespace:
    """The `conveyor eval` arguments of one format."""
    return argparse.Namespace(
        model=args.model, device="cpu", threads=args.threads, quantization_ignore=QUALITY[key][2]
    )


def run_quality(args) -> dict[str, dict]:
    from services.eval.cli import _runner, _tokenizer
    from services.eval.quality import PROMPTS, agreement, corpus_text, greedy, make_windows
    from services.eval.quality import perplexity as score

    tokenizer = _tokenizer(args.model)
    windows = make_windows(tokenizer.encode(corpus_text()).ids, args.window, args.num_windows)
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    max_len = max(args.window, max(map(len, prompts)) + 32)
    results: dict[str, dict] = {}
    for key, (dtype, quantization, _) in QUALITY.items():
        runner = _runner(_namespace(args, key), dtype, quantization, max_len)
        ppl = score(runner, windows)
        results[key] = {"perplexity": ppl.value, "tokens": ppl.num_tokens, "seconds": ppl.seconds}
        results[key]["greedy"] = greedy(runner, prompts, 32)
        print(f"--- {key}: perplexity {ppl.value:.4f} ({ppl.seconds:.0f} s)", flush=True)
    for key, reference in (
        ("int8", "bf16"),
        ("fp8", "bf16"),
        ("fp8-all", "bf16"),
        ("bf16", "fp32"),
    ):
        agree = agreement(results[key]["greedy"], results[reference]["greedy"])
        results[key][f"agreement_vs_{reference}"] = {
            "identical": f"{agree.num_identical}/{agree.num_prompts}",
            "prefix": agree.prefix_fraction,
            "tokens": agree.token_fraction,
        }
    return results


def table(speed: dict[str, dict], quality: dict[str, dict]) -> str:
    rows = ["format  1-req TPOT ms  burst out tok/s  others' cores  perplexity  greedy vs"]
    for key in QUALITY:
        s, q = speed.get(key, {}), quality[key]
        agree = next((v for k, v in q.items() if k.startswith("agreement_vs_")), None)
        vs = f"{agree['identical']} identical, {agree['tokens']:.2f} of tokens" if agree else "-"
        tpot = f"{s['single_request_tpot_ms']:.1f}" if s else "-"
        tput = f"{s['output_throughput']:.1f}" if s else "-"
        others = f"{s.get('cpu', {}).get('other_cores', 0):.2f}" if s else "-"
        rows.append(f"{key:7} {tpot:>12}  {tput:>15}  {others:>13}  {q['perplexity']:10.4f}  {vs}")
    p = {k: q["perplexity"] for k, q in quality.items()}
    rows += [
        "",
        f"perplexity int8 / fp32            {p['int8'] / p['fp32']:.4f}  (target <= 1.01)",
        f"perplexity fp8 / bf16             {p['fp8'] / p['bf16']:.4f}  (target <= 1.01)",
        f"perplexity fp8-all / bf16         {p['fp8-all'] / p['bf16']:.4f}",
        f"perplexity bf16 / fp32            {p['bf16'] / p['fp32']:.4f}",
    ]
    if not speed:
        return "\n".join(rows)
    ratio = lambda a, b, m: speed[a][m] / speed[b][m]  # noqa: E731
    rows += [
        f"int8 / bf16 one-request TPOT      {ratio('int8', 'bf16', 'single_request_tpot_ms'):.2f}"
        "  (target <= 0.65)",
        f"int8 / bf16 burst throughput      {ratio('int8', 'bf16', 'output_throughput'):.2f}"
        "  (target >= 0.95)",
        f"int8 / fp32 one-request TPOT      {ratio('int8', 'fp32', 'single_request_tpot_ms'):.2f}",
        f"int8 / fp32 burst throughput      {ratio('int8', 'fp32', 'output_throughput'):.2f}",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path.home() / ".cache/conveyor/models/smollm2-135m"))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--num-windows", type=int, default=12)
    parser.add_argument("--results-dir", default="bench/results/quant")
    parser.add_argument(
        "--decode-only", action="store_true", help="only the in-process decode-step timing"
    )
    parser.add_argument(
        "--quality-only", action="store_true", help="only perplexity and greedy agreement"
    )
    args = parser.parse_args(argv)
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    if args.quality_only:
        quality = run_quality(args)
        (results_dir / "quant_quality.json").write_text(json.dumps({"quality": quality}))
        print(table({}, quality))
        return 0
    decode = run_decode(args)
    print(decode_table(decode))
    if args.decode_only:
        return 0
    speed = run_speed(args, results_dir)
    quality = run_quality(args)
    results = {"speed": speed, "quality": quality, "decode": decode}
    (results_dir / "quant.json").write_text(json.dumps(results))
    print(table(speed, quality))
    print(decode_table(decode))
    return 0


def decode_table(decode: dict[str, dict]) -> str:
    keys = list(decode["int8"])
    rows = ["decode step ms (median)  " + "  ".join(f"{k:>18}" for k in keys)]
    for fmt, values in decode.items():
        rows.append(f"{fmt:23}  " + "  ".join(f"{values[k]:18.1f}" for k in keys))
    for ref in ("bf16", "fp32"):
        ratios = "  ".join(f"{decode['int8'][k] / decode[ref][k]:18.2f}" for k in keys)
        rows.append(f"{'int8 / ' + ref:23}  {ratios}")
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
