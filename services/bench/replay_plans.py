"""A stage's recorded plans run again in process, alone, beside the stack's timeline.

    conveyor up ... --record-plans plans/ --timeline trace.json     # then a workload, then stop
    python -m services.bench.replay_plans plans/stage0.plans --timeline trace.json

Rebuilds the recorded stage's `StageRunner` from the recording's header (its model, dtype,
layers, threads, KV budget; `--threads` overrides) and runs every plan through it in order,
as the worker did, but with nothing else in the process and no other service running: the
same steps, on the same requests and KV blocks. A stage after the first gets zeros for its
activations and an async stage 0 token 0 for its decode inputs (a step's time does not depend
on the values). Prints, per kind of step (requests, tokens), the median time of a step here
and, with `--timeline`, in the stack (that stage's track of `conveyor up --timeline`), and
the totals: what the stack's environment (its other processes on the same cores, the
transport, the control plane's wake-ups) added to the stage's own work. With one stage and sync
scheduling the plans carry the tokens the stack sampled, and the replay checks it samples the
same ones.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import ConfigError
from services.common.pb import plan_from_pb
from services.worker.plan_record import SESSION_START, read_header, read_plans, runner_config

StepKind = tuple[int, int]  # (requests, tokens)


@dataclass
class Replay:
    times: dict[StepKind, list[float]]
    """The seconds of each step run alone, by kind."""
    compared: int
    """Sampled tokens checked against the ones the stack's next plans carried (one stage,
    sync: async plans carry none)."""
    mismatches: int


def replay(runner, recording: Path) -> Replay:
    """Runs the recorded plans through `runner`, in order, timing each step."""
    import torch

    stage = runner.model.stage
    hidden_size = runner.model.config.hidden_size
    weight = next(runner.model.parameters())
    times: dict[StepKind, list[float]] = collections.defaultdict(list)
    checks = stage.is_first and stage.is_last  # elsewhere the inputs are made up
    sampled: dict[str, int] = {}  # request -> the token its last step sampled
    compared = mismatches = 0
    with torch.inference_mode():
        for msg in read_plans(recording):
            if msg is SESSION_START:
                runner.requests.clear()
                sampled.clear()
                continue
            plan = plan_from_pb(msg)
            for cached in plan.cached_requests:  # the tokens the last step sampled
                expected = sampled.pop(cached.request_id, None)
                if expected is not None and cached.new_token_ids:
                    compared += 1
                    mismatches += cached.new_token_ids[-1] != expected
            hidden_in, inputs = None, None
            if not stage.is_first and plan.num_requests:
                hidden_in = torch.zeros(
                    plan.num_scheduled_tokens, hidden_size, dtype=weight.dtype, device=weight.device
                )
            if stage.is_first and msg.tokens_from_last_stage and stage.num_stages > 1:
                inputs = {
                    c.request_id: 0
                    for c in plan.cached_requests
                    if (state := runner.requests.get(c.request_id)) is not None
                    and state.num_computed_tokens >= len(state.token_ids)
                }
            start = time.perf_counter()
            out = runner.execute(plan, hidden_in=hidden_in, input_token_ids=inputs)
            if weight.is_cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if plan.num_requests:
                times[(plan.num_requests, plan.num_scheduled_tokens)].append(elapsed)
            if checks:
                sampled.update((request_id, tokens[-1]) for request_id, tokens, _ in out.runs())
    return Replay(dict(times), compared, mismatches)


def stack_times(trace: Path, stage: int) -> dict[StepKind, list[float]]:
    """The seconds of each step of `stage` in a `conveyor up --timeline` trace, by kind."""
    times: dict[StepKind, list[float]] = collections.defaultdict(list)
    for event in json.loads(trace.read_text())["traceEvents"]:
        if event.get("ph") == "X" and event.get("tid") == stage:
            args = event["args"]
            times[(args["requests"], args["tokens"])].append(event["dur"] / 1e6)
    return times


def report(replayed: dict, stacked: dict | None, top: int = 8) -> str:
    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:9.1f}" if values else f"{'-':>9}"

    lines = [
        f"{'requests':>8} {'tokens':>7} {'steps':>6} {'alone ms':>9} {'stack ms':>9} {'ratio':>6}"
    ]
    kinds = sorted(replayed, key=lambda k: -sum(replayed[k]))[:top]
    for kind in kinds:
        alone, stack = replayed[kind], (stacked or {}).get(kind, [])
        ratio = statistics.median(stack) / statistics.median(alone) if stack else None
        lines.append(
            f"{kind[0]:>8} {kind[1]:>7} {len(alone):>6} {ms(alone)} {ms(stack)} "
            + (f"{ratio:6.2f}" if ratio else f"{'-':>6}")
        )
    total = sum(map(sum, replayed.values()))
    line = f"all {sum(map(len, replayed.values()))} steps: {total:.2f} s alone"
    if stacked:
        stack_total = sum(map(sum, stacked.values()))
        line += f", {stack_total:.2f} s in the stack ({stack_total / total:.2f}x)"
    return "\n".join([*lines, line])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recording", type=Path, help="a worker's --record-plans file")
    parser.add_argument(
        "--timeline", type=Path, default=None, help="the stack's `conveyor up --timeline` trace"
    )
    parser.add_argument("--threads", type=int, default=None, help="default: the recorded stage's")
    parser.add_argument("--model", default=None, help="default: the recorded model directory")
    args = parser.parse_args(argv)
    try:
        header = read_header(args.recording)
        if header.get("tensor_parallel_size", 1) > 1:
            raise ConfigError(
                "the recording is of a tensor-parallel rank: its collectives need the other "
                "ranks, so it cannot run alone"
            )
        if header.get("device") == "sim":
            raise ConfigError("the recording is of a simulated stage: nothing to run again")
        if args.threads:
            header["num_threads"] = args.threads
        if args.model:
            header["model_dir"] = args.model
        import torch

        from services.worker.runner import StageRunner

        runner = StageRunner.from_config(runner_config(header))
        replayed = replay(runner, args.recording)
        stacked = stack_times(args.timeline, header["stage_index"]) if args.timeline else None
    except ConfigError as exc:
        parser.exit(2, f"replay_plans: error: {exc}\n")
    print(
        f"stage {header['stage_index']} of {header['num_stages']}, {header['dtype']}, "
        f"{torch.get_num_threads()} thread(s): the recorded plans alone"
        + (f" against {args.timeline}" if stacked else "")
    )
    print(report(replayed.times, stacked))
    if replayed.compared:
        print(
            f"sampled tokens: {replayed.compared - replayed.mismatches} of {replayed.compared} "
            "the same as the stack's"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
