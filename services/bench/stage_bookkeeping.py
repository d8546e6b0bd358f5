"""CPU cost of a stage worker's per-step bookkeeping, without any forward pass.

    python -m services.bench.stage_bookkeeping [--steps 64] [--repeats 15] [--cases ...]

Plan streams as the scheduler sends them in sync mode: N (1, 32, 256) requests decoding one
token a step, contexts growing (each a different length; a block appended every block_size
tokens), and a mix of 32 decodes with one new request's 256-token prefill chunk every step
(the previous one finished). Columns, CPU microseconds per step (`time.process_time` over
`--steps` steps, median of `--repeats` runs, so that another process's load on the machine
shows as spread, not as cost):

    prepare    what a real stage runs before its kernels: `_apply_plan` (the plan's deltas
               into the request states) + `_prepare` (attention metadata, stage 0's input
               ids), on stage 0 of 8
    sim first  `SimStageRunner.execute` of stage 0 of 8, no modeled time (the bookkeeping,
               the timing model, the wire tensor to the next stage)
    sim last   the same for stage 7 of 8 (the wire check, the sim's sampling)
    plan pb    a worker's decoding of the plan message: parse + `plan_from_pb`
    report pb  the last stage's report (`outcome_to_pb` + serialize) and the tensor of
               tokens it forwards to stage 0 in async mode

The model is Llama-3-70B's config (the sim experiment's); only its vocabulary matters here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.pb import plan_from_pb, plan_to_pb
from services.common.proto.conveyor.v1 import worker_pb2
from services.common.sampling import SamplingParams
from services.common.step import CachedRequest, NewRequest, StepPlan
from services.worker.config import WorkerConfig
from services.worker.engine import StepOutcome, StepRecord
from services.worker.server import outcome_to_pb
from services.worker.sim import MODELS_DIR
from services.worker.sim.runner import SimStageRunner

BLOCK_SIZE = 16
PREFILL_CHUNK = 256


@dataclass(slots=True)
class Case:
    name: str
    num_decodes: int
    prompt_len: int
    """Decodes start at contexts prompt_len ... prompt_len + prompt_len // 2 (spread)."""
    with_prefill: bool = False


CASES = {
    c.name: c
    for c in [
        Case("decode-1", 1, 128),
        Case("decode-32", 32, 128),
        Case("decode-256", 256, 128),
        Case("decode-256-ctx2k", 256, 2048),
        Case("mixed-32+prefill", 32, 128, with_prefill=True),
    ]
}


class PlanStream:
    """The plans of one case: a first plan that registers every request (untimed), then
    `num_steps` steady-state plans."""

    def __init__(self, case: Case, num_steps: int) -> None:
        self.case = case
        self.next_block = 0
        self.contexts = [
            case.prompt_len + (i * 37) % max(case.prompt_len // 2, 1)
            for i in range(case.num_decodes)
        ]
        self.first = StepPlan(0, new_requests=[self._new(i) for i in range(case.num_decodes)])
        self.steps = [self._step(step) for step in range(1, num_steps + 1)]

    def _blocks(self, num: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + num))
        self.next_block += num
        return ids

    def _new(self, i: int) -> NewRequest:
        """Request i with its context minus one computed: its next step decodes."""
        context = self.contexts[i]
        tokens = [(i * 131 + p) % 30000 + 100 for p in range(context)]
        blocks = self._blocks(-(-context // BLOCK_SIZE))
        return NewRequest(
            f"r{i}", tokens, self.case.prompt_len, SamplingParams(), blocks, context - 1, 1
        )

    def _step(self, step: int) -> StepPlan:
        plan = StepPlan(step)
        if self.case.with_prefill:
            if step > 1:
                plan.finished_request_ids.append(f"p{step - 1}")
            tokens = [(step * 17 + p) % 30000 + 100 for p in range(PREFILL_CHUNK)]
            blocks = self._blocks(PREFILL_CHUNK // BLOCK_SIZE)
            plan.new_requests.append(
                NewRequest(
                    f"p{step}", tokens, PREFILL_CHUNK, SamplingParams(), blocks, 0, PREFILL_CHUNK
                )
            )
        for i, context in enumerate(self.contexts):
            # this step computes position `context` (the token sampled last step)
            new_blocks = self._blocks(1) if context % BLOCK_SIZE == 0 else []
            token = (i * 131 + context) % 30000 + 100
            plan.cached_requests.append(CachedRequest(f"r{i}", 1, new_blocks, [token]))
            self.contexts[i] = context + 1
        return plan


NUM_STAGES = 8
"""Stages of the modeled pipeline: 8 H200s hold the KV of 256 requests at 2-3k tokens of
Llama-3-70B (2 do not: a plan's block ids must fit the stage's cache, as the worker checks).
The bookkeeping does not depend on a stage's number of layers."""


def sim_runner(stage_index: int) -> SimStageRunner:
    """A simulated stage of NUM_STAGES (Llama-3-70B on an H200) that does not sleep."""
    config = WorkerConfig(
        model_dir=str(MODELS_DIR / "llama-3-70b"),
        stage_index=stage_index,
        num_stages=NUM_STAGES,
        device="sim",
        sim_profile="h200",
        max_model_len=8192,
    )
    runner = SimStageRunner.from_config(config)
    runner.sleeper.sleep_for = lambda seconds: None
    return runner


def prepare_step(runner: SimStageRunner, plan: StepPlan) -> None:
    """What `StageRunner.execute` does around the forward: deltas, metadata, counts."""
    batch = runner._apply_plan(plan, None)
    runner._prepare(batch)
    for state, num in zip(batch.states, batch.num_scheduled, strict=True):
        state.num_computed_tokens += num


def cpu_us_per_step(
    setup: Callable[[], None], steps: list, run: Callable, repeats: int
) -> tuple[float, float, float]:
    """(median, min, max) CPU µs per step of `run(item)` over `steps`, each repeat after
    `setup()` (untimed)."""
    per_step = []
    for _ in range(repeats):
        setup()
        start = time.process_time()
        for item in steps:
            run(item)
        per_step.append((time.process_time() - start) / len(steps) * 1e6)
    return statistics.median(per_step), min(per_step), max(per_step)


def measure(case: Case, num_steps: int, repeats: int) -> dict[str, tuple[float, float, float]]:
    stream = PlanStream(case, num_steps)
    first, last = sim_runner(0), sim_runner(NUM_STAGES - 1)

    def reset(*runners: SimStageRunner) -> Callable[[], None]:
        def setup() -> None:
            for runner in runners:
                runner.requests.clear()
                runner._keys.clear()
                runner.execute(stream.first)

        return setup

    # the wires stage 0 sends, so that stage 1 checks real ones
    reset(first)()
    wires = [(plan, first.execute(plan)) for plan in stream.steps]
    reset(last)()
    results = [last.execute(plan, hidden_in=wire) for plan, wire in wires]
    messages = [plan_to_pb(plan, False).SerializeToString() for plan in stream.steps]
    outcomes = [StepOutcome(r.step_id, StepRecord(r.step_id, 1, 1, 0, 1, 0), r) for r in results]

    def report(outcome: StepOutcome) -> None:
        outcome_to_pb(outcome, 1).SerializeToString()
        torch.tensor(outcome.result.last_tokens(), dtype=torch.int64)

    return {
        "prepare": cpu_us_per_step(
            reset(first), stream.steps, lambda plan: prepare_step(first, plan), repeats
        ),
        "sim first": cpu_us_per_step(reset(first), stream.steps, first.execute, repeats),
        "sim last": cpu_us_per_step(
            reset(last), wires, lambda item: last.execute(item[0], hidden_in=item[1]), repeats
        ),
        "plan pb": cpu_us_per_step(
            lambda: None,
            messages,
            lambda data: plan_from_pb(worker_pb2.StepPlan.FromString(data)),
            repeats,
        ),
        "report pb": cpu_us_per_step(lambda: None, outcomes, report, repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs (median)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"CPU µs per step, median [min-max] of {args.repeats} runs of {args.steps} steps; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    columns = ["prepare", "sim first", "sim last", "plan pb", "report pb"]
    print(f"{'case':<18}" + "".join(f"{c:>20}" for c in columns))
    for name in args.cases:
        row = measure(CASES[name], args.steps, args.repeats)
        cells = [f"{row[c][0]:.0f} [{row[c][1]:.0f}-{row[c][2]:.0f}]" for c in columns]
        print(f"{name:<18}" + "".join(f"{cell:>20}" for cell in cells))
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
