"""Factories and a fake pipeline for scheduler tests.

`FakeWorkers` plays the stage workers' side of the step-plan protocol and fails loudly when a
plan breaks it (a cached request the workers never got, a token computed before it is known,
a block table too short). Its "model" is deterministic: the token at position p of request r
is `fake_token(r, p)`, whatever the batching, chunking, preemption or restart, so every
schedule must produce exactly `expected_output(...)`.
"""

from __future__ import annotations

import zlib
from collections import deque
from dataclasses import dataclass, field

from services.common.sampling import SamplingParams
from services.common.step import StepPlan, StepResult
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

EOS = 7
VOCAB = 64  # small, so EOS (1 in 64) ends some requests early


def fake_token(request_id: str, position: int) -> int:
    return zlib.crc32(f"{request_id}:{position}".encode()) % VOCAB


def make_config(**overrides) -> SchedulerConfig:
    values = dict(
        num_blocks=128,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=128,
    )
    values.update(overrides)
    return SchedulerConfig(**values)


def make_request(
    request_id: str,
    prompt_len: int = 10,
    max_tokens: int = 8,
    prompt: list[int] | None = None,
    ignore_eos: bool = False,
    **kwargs,
) -> Request:
    if prompt is None:
        prompt = [100 + fake_token(request_id + "/p", i) for i in range(prompt_len)]
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    kwargs.setdefault("eos_token_ids", (EOS,))
    return Request(request_id, list(prompt), sampling, **kwargs)


def expected_output(request: Request, max_model_len: int) -> list[int]:
    """The output the fake model must produce for a fresh copy of `request`."""
    out: list[int] = []
    num_prompt = request.num_prompt_tokens
    params = request.sampling
    while True:
        token = fake_token(request.request_id, num_prompt + len(out))
        out.append(token)
        if token in request.eos_token_ids and not params.ignore_eos:
            return out
        if token in params.stop_token_ids or len(out) >= params.max_tokens:
            return out
        if num_prompt + len(out) >= max_model_len:
            return out


@dataclass(slots=True)
class _WorkerSeq:
    token_ids: list[int]
    num_computed: int
    block_ids: list[int]


@dataclass(slots=True)
class FakeWorkers:
    """The workers' side of the protocol, with a deterministic model."""

    is_async: bool
    block_size: int
    seqs: dict[str, _WorkerSeq] = field(default_factory=dict)
    computed: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Per request: (start, end) token ranges computed, reset when it is sent anew."""

    def run(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self.seqs.pop(request_id, None)
        ids, tokens = [], []
        for new in plan.new_requests:
            assert new.request_id not in self.seqs, f"{new.request_id} sent twice"
            seq = _WorkerSeq(list(new.token_ids), new.num_computed_tokens, list(new.block_ids))
            self.seqs[new.request_id] = seq
            self.computed[new.request_id] = []
            self._compute(new.request_id, seq, new.num_scheduled_tokens, ids, tokens)
        for cached in plan.cached_requests:
            seq = self.seqs[cached.request_id]  # KeyError: workers never got this request
            seq.block_ids.extend(cached.new_block_ids)
            if self.is_async:
                assert not cached.new_token_ids
            else:
                seq.token_ids.extend(cached.new_token_ids)
            self._compute(cached.request_id, seq, cached.num_scheduled_tokens, ids, tokens)
        return StepResult(plan.step_id, ids, tokens)

    def _compute(self, request_id, seq, num_new, ids, tokens) -> None:
        start, end = seq.num_computed, seq.num_computed + num_new
        assert num_new >= 1
        assert end <= len(seq.token_ids), f"{request_id}: computing tokens it does not know"
        assert len(seq.block_ids) * self.block_size >= end, f"{request_id}: no KV slot"
        self.computed[request_id].append((start, end))
        seq.num_computed = end
        if end == len(seq.token_ids):
            token = fake_token(request_id, end)
            ids.append(request_id)
            tokens.append(token)
            if self.is_async:  # the last stage hands the token straight to stage 0
                seq.token_ids.append(token)


@dataclass(slots=True)
class Trace:
    plans: list[StepPlan] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    process_steps: list[tuple[int, int]] = field(default_factory=list)
    """(step planned just after, step whose result was processed)."""


def drive(
    scheduler: Scheduler,
    workers: FakeWorkers,
    result_delay: int,
    max_steps: int = 5000,
    trace: Trace | None = None,
    on_step=None,
) -> Trace:
    """Run plans through the fake workers; the result of step s is processed just before
    step s + result_delay is planned. Where an empty plan gives its id back (speculation,
    async), the step counter jumps to a request the pipeline rule holds, as the service
    does, or else the next result is processed at once. Stops when nothing is left (or
    after max_steps)."""
    trace = trace or Trace()
    in_flight: deque[tuple[int, StepResult]] = deque()
    for _ in range(max_steps):
        if not scheduler.has_unfinished and not in_flight:
            break
        next_step = scheduler.next_step_id
        while in_flight and in_flight[0][0] <= next_step:
            result = in_flight.popleft()[1]
            trace.process_steps.append((next_step, result.step_id))
            collect(trace, scheduler.process_result(result))
        plan = scheduler.schedule()
        if scheduler.next_step_id == plan.step_id:  # empty: its id was given back
            if not scheduler.skip_to_next_ready(plan.step_id) and in_flight:
                result = in_flight.popleft()[1]
                trace.process_steps.append((plan.step_id, result.step_id))
                collect(trace, scheduler.process_result(result))
            continue
        trace.plans.append(plan)
        in_flight.append((plan.step_id + result_delay, workers.run(plan)))
        if on_step is not None:
            on_step(plan)
    return trace


def collect(trace: Trace, deltas) -> None:
    for delta in deltas:
        out = trace.outputs.setdefault(delta.request_id, [])
        assert delta.offset == len(out), f"{delta.request_id}: delta offset skips or repeats"
        out.extend(delta.token_ids)
        if delta.finish_reason is not None:
            trace.finish_reasons[delta.request_id] = delta.finish_reason
