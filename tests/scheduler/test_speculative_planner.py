"""Speculative decoding in the planner: the n-gram proposer, the config, adaptivity, and
random workloads through fake workers that verify proposals like the last stage does.

The fake model is a "copying" one for requests named `rep*`: the token at position p is
prompt[p % len(prompt)], so outputs repeat the prompt and prompt lookup is right most of
the time; `late*` requests write LATE_START tokens of their own first (each new), then
copy; other requests use the crc model of tests/scheduler/utils.py (proposals mostly
wrong). Every schedule must produce exactly the tokens the model defines, whatever was
proposed, accepted, preempted or stopped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.errors import ConfigError
from services.common.step import StepPlan, StepResult
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.speculative import (
    SpecStats,
    SpeculativeConfig,
    next_num_tokens,
    propose_ngram,
    tail_recurs,
)
from tests.scheduler.utils import Trace, collect, drive, fake_token, make_config, make_request

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)


# -- proposer, config, adaptivity ------------------------------------------------------------
def test_propose_ngram_takes_what_followed_the_longest_suffix():
    log = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 1, 2, 3]
    assert propose_ngram(log, 3, 3, 1) == [4, 5, 9]  # "1 2 3" beats the later "2 3"
    assert propose_ngram([8, 2, 3, 6, 2, 3], 2, 3, 1) == [6, 2]
    assert propose_ngram([1, 2, 3, 4], 4, 3, 1) == []  # nothing repeats
    assert propose_ngram([5, 6, 5, 6], 4, 3, 3) == []  # shorter than prompt_lookup_min
    assert propose_ngram([5, 5, 5, 5, 5, 5], 3, 2, 1) == [5, 5, 5]
    assert propose_ngram([7, 7], 3, 4, 1) == [7]  # only a continuation that runs short
    assert propose_ngram([1, 2, 1], 0, 3, 1) == []


def test_tail_recurs_finds_an_earlier_occurrence_of_the_last_tokens():
    assert tail_recurs([1, 2, 3, 9, 1, 2, 3], 3)
    assert not tail_recurs([1, 2, 3, 9, 1, 2, 4], 3)
    assert tail_recurs([5, 5, 5, 5], 3)  # overlapping: "5 5 5" at 0 and at 1
    assert not tail_recurs([1, 2, 3], 3)  # only the tail itself
    assert not tail_recurs([1, 2], 0)
    # int32 bytes of 256, 0 hold those of 1 across an id boundary: not an occurrence
    assert not tail_recurs([256, 0, 5, 1], 1)
    assert tail_recurs([256, 1, 5, 1], 1)


def test_tail_recurs_with_packed_bytes_kept_between_calls_answers_the_same():
    log = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8]
    packed = bytearray()
    for end in range(1, len(log) + 1):
        for length in (1, 2, 3):
            assert tail_recurs(log[:end], length, packed) == tail_recurs(log[:end], length)
    assert tail_recurs([7, 7], 1, packed) is True  # a shorter log than the bytes: rebuilt


def test_speculative_config_parses_vllm_json_and_names_bad_values():
    config = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_max) == (3, 5)
    assert SpeculativeConfig.from_json(config.to_json()) == config
    bad = {
        "{": "not valid JSON",
        "[1]": "must be a JSON object",
        '{"method": "eagle"}': "method='eagle' is not one of ['ngram', 'draft_model']",
        '{"method": "draft_model"}': 'needs "model"',
        '{"num_speculative_tokens": 0}': "num_speculative_tokens=0 is out of range",
        '{"num_speculative_tokens": true}': "num_speculative_tokens=True",
        '{"prompt_lookup_max": 2, "prompt_lookup_min": 3}': "prompt_lookup_min=3",
        '{"num_spec_tokens": 4}': "unknown key(s) ['num_spec_tokens']",
    }
    for text, message in bad.items():
        with pytest.raises(ConfigError, match="speculative-config") as info:
            SpeculativeConfig.from_json(text)
        assert message in str(info.value), (text, str(info.value))
    assert make_config(
        speculative='{"num_speculative_tokens": 2}'
    ).speculative == SpeculativeConfig(num_speculative_tokens=2)


def test_adaptivity_grows_on_full_acceptance_and_halves_on_misses():
    assert next_num_tokens(3, 3, 3, max_k=4) == 4
    assert next_num_tokens(4, 4, 4, max_k=4) == 4
    assert next_num_tokens(4, 4, 2, max_k=4) == 4
    assert next_num_tokens(4, 4, 0, max_k=4) == 2
    assert next_num_tokens(4, 0, 0, max_k=4) == 2  # nothing proposed
    assert next_num_tokens(1, 1, 0, max_k=4) == 0
    stats = SpecStats()
    stats.add(4, 4)
    stats.add(4, 0)
    assert (stats.acceptance_rate, stats.mean_accepted_length) == (0.5, 3.0)


# -- fake workers that verify proposals --------------------------------------------------------
LATE_START = 40


def model_token(request: Request, position: int) -> int:
    if request.request_id.startswith("rep"):
        return request.prompt_token_ids[position % request.num_prompt_tokens]
    if request.request_id.startswith("late"):
        if position < request.num_prompt_tokens + LATE_START:
            return 1000 + position  # in neither the prompt nor the output before
        return request.prompt_token_ids[position % request.num_prompt_tokens]
    return fake_token(request.request_id, position)


def expected_output(request: Request, max_model_len: int) -> list[int]:
    out: list[int] = []
    while True:
        token = model_token(request, request.num_prompt_tokens + len(out))
        out.append(token)
        if token in request.eos_token_ids and not request.sampling.ignore_eos:
            return out
        if len(out) >= request.sampling.max_tokens:
            return out
        if request.num_prompt_tokens + len(out) >= max_model_len:
            return out


@dataclass(slots=True)
class _Seq:
    token_ids: list[int]
    num_computed: int
    block_ids: list[int]


@dataclass
class SpecWorkers:
    """One stage that is first and last: checks every plan entry against what it holds,
    computes the proposed positions, and keeps the prefix the model agrees with."""

    requests: dict[str, Request]
    is_async: bool
    block_size: int
    seqs: dict[str, _Seq] = field(default_factory=dict)
    num_rollbacks: int = 0

    def run(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self.seqs.pop(request_id, None)
        ids, tokens = [], []
        for new in plan.new_requests:
            assert new.request_id not in self.seqs
            seq = _Seq(list(new.token_ids), new.num_computed_tokens, list(new.block_ids))
            self.seqs[new.request_id] = seq
            self._compute(new.request_id, seq, new.num_scheduled_tokens, [], ids, tokens)
        for cached in plan.cached_requests:
            seq = self.seqs[cached.request_id]
            seq.block_ids.extend(cached.new_block_ids)
            if cached.num_computed_tokens is not None:
                # the last stage knows the true count: the plan must agree with it
                assert cached.num_computed_tokens == seq.num_computed
                self.num_rollbacks += 1
            new_ids = cached.new_token_ids
            if new_ids:
                needed = seq.num_computed + cached.num_scheduled_tokens
                start = needed - len(new_ids)
                known = seq.token_ids[start:needed]
                assert known == new_ids[: len(known)], "a plan rewrote a known token"
                del seq.token_ids[start:]
                seq.token_ids.extend(new_ids)
            elif not self.is_async:
                assert not cached.spec_token_ids or cached.num_scheduled_tokens == 1
            self._compute(
                cached.request_id,
                seq,
                cached.num_scheduled_tokens,
                cached.spec_token_ids,
                ids,
                tokens,
            )
        return StepResult(plan.step_id, ids, tokens)

    def _compute(self, request_id, seq, num_new, spec, ids, tokens) -> None:
        end = seq.num_computed + num_new
        assert end <= len(seq.token_ids), f"{request_id}: computing tokens it does not know"
        slots = end + len(spec)
        assert len(seq.block_ids) * self.block_size >= slots, f"{request_id}: no KV slot"
        if spec:
            assert end == len(seq.token_ids), "proposals only after the last known token"
        seq.num_computed = end
        if end < len(seq.token_ids):
            return
        request = self.requests[request_id]
        emitted = []
        for i in range(len(spec) + 1):
            emitted.append(model_token(request, end + i))
            if i == len(spec) or emitted[-1] != spec[i]:
                break
        seq.num_computed = end + len(emitted) - 1
        seq.token_ids.extend(emitted)
        ids.extend([request_id] * len(emitted))
        tokens.extend(emitted)


def _run(config, requests, delay):
    scheduler = Scheduler(config)
    for request in requests:
        scheduler.add_request(request)
    by_id = {r.request_id: r for r in requests}
    workers = SpecWorkers(by_id, config.is_async, config.block_size)
    trace = drive(scheduler, workers, delay, trace=Trace())
    return scheduler, workers, trace


def _requests(specs) -> list[Request]:
    requests = []
    for i, (prompt_len, max_tokens, copies) in enumerate(specs):
        name = f"rep{i}" if copies else f"q{i}"
        requests.append(make_request(name, prompt_len, max_tokens, arrival_time=float(i)))
    return requests


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4, 8]))
    max_model_len = draw(st.sampled_from([32, 64]))
    num_stages = draw(st.integers(1, 3))
    config = make_config(
        scheduling=draw(st.sampled_from(["sync", "async"])),
        num_stages=num_stages,
        block_size=block_size,
        num_blocks=draw(st.integers(max_model_len // block_size, 60)),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(2, 40)),
        max_model_len=max_model_len,
        policy=draw(st.sampled_from(["fcfs", "priority", "fair"])),
        speculative=SpeculativeConfig(
            num_speculative_tokens=draw(st.integers(1, 5)),
            prompt_lookup_max=draw(st.integers(1, 4)),
        ),
    )
    specs = draw(
        st.lists(
            st.tuples(st.integers(1, 24), st.integers(1, 30), st.booleans()),
            min_size=1,
            max_size=8,
        )
    )
    return config, _requests(specs), draw(st.integers(num_stages, num_stages + 2))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_speculative_random_workloads_produce_exact_outputs(workload):
    config, requests, delay = workload
    expected = {r.request_id: expected_output(r, config.max_model_len) for r in requests}
    scheduler, _, trace = _run(config, requests, delay)
    assert not scheduler.has_unfinished
    assert trace.outputs == expected
    assert scheduler.block_manager.num_free_blocks == config.num_blocks
    for plan in trace.plans:
        assert plan.num_scheduled_tokens <= config.max_num_batched_tokens


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_speculative_copying_requests_take_fewer_steps_and_adapt(scheduling):
    config = make_config(scheduling=scheduling, num_stages=2, speculative=SPEC)
    requests = _requests([(8, 30, True), (9, 30, False)])
    scheduler, workers, trace = _run(config, requests, 2)
    assert trace.outputs == {r.request_id: expected_output(r, 128) for r in requests}
    per_step = {}
    for plan in trace.plans:
        for entry in plan.cached_requests:
            per_step.setdefault(entry.request_id, []).append(len(entry.spec_token_ids))
    copying, other = per_step["rep0"], per_step["q1"]
    assert len(copying) < 30 / 2, "accepted proposals: several tokens per step"
    assert max(copying) == SPEC.num_speculative_tokens
    # The other request's proposals fail: its k falls to 0 and it decodes without them.
    assert other[-8:] == [0] * 8
    stats = scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert workers.num_rollbacks > 0


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_a_request_whose_output_begins_to_repeat_probes_early(scheduling):
    """A request that writes 40 new tokens, then copies its prompt: its k falls to 0 at
    once, its timed probe (after 16 tokens) finds nothing and the next would come 32
    tokens later, but as soon as its output repeats a lookup's worth of tokens it probes
    again and speculates from there on, with exactly the model's tokens."""
    config = make_config(scheduling=scheduling, num_stages=2, speculative=SPEC)
    request = make_request("late0", 8, 80, ignore_eos=True)
    expected = expected_output(request, config.max_model_len)
    scheduler = Scheduler(config)
    scheduler.add_request(request)
    workers = SpecWorkers({"late0": request}, config.is_async, config.block_size)
    proposing_at = []  # the request's output count when a step with proposals was planned

    def on_step(plan):
        if any(e.spec_token_ids for e in plan.cached_requests):
            proposing_at.append(request.num_output_tokens)

    trace = drive(scheduler, workers, 2, trace=Trace(), on_step=on_step)
    assert trace.outputs == {"late0": expected}
    copying = [p for p in proposing_at if p >= LATE_START]
    # repeating since LATE_START: a lookup (3 tokens) and one more, then the next plan
    assert copying[0] <= LATE_START + SPEC.prompt_lookup_max + 3, proposing_at
    assert scheduler.spec_stats.num_accepted_tokens > (80 - LATE_START) // 2


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_speculative_request_is_not_planned_while_its_step_is_in_flight(scheduling):
    config = make_config(scheduling=scheduling, num_stages=1, speculative=SPEC)
    scheduler = Scheduler(config)
    request = _requests([(8, 30, True)])[0]
    scheduler.add_request(request)
    workers = SpecWorkers({request.request_id: request}, config.is_async, config.block_size)
    prefill = scheduler.schedule()
    assert scheduler.schedule().num_requests == 0, "planned before its first token is known"
    scheduler.process_result(workers.run(prefill))
    step = scheduler.schedule()
    (entry,) = step.cached_requests
    assert entry.spec_token_ids and entry.num_computed_tokens == request.num_prompt_tokens
    assert scheduler.schedule().num_requests == 0, "planned while a speculative step flies"
    deltas = scheduler.process_result(workers.run(step))
    assert len(deltas[0].token_ids) == len(entry.spec_token_ids) + 1


def test_speculative_result_that_does_not_extend_the_proposal_is_refused():
    config = make_config(scheduling="sync", speculative=SPEC)
    scheduler = Scheduler(config)
    request = _requests([(8, 30, True)])[0]
    scheduler.add_request(request)
    workers = SpecWorkers({request.request_id: request}, False, config.block_size)
    scheduler.process_result(workers.run(scheduler.schedule()))
    step = scheduler.schedule()
    drafts = step.cached_requests[0].spec_token_ids
    rid = request.request_id
    too_many = StepResult(step.step_id, [rid] * (len(drafts) + 2), [*drafts, 1, 2])
    wrong = StepResult(step.step_id, [rid] * 2, [drafts[0] + 1, 5])
    split = StepResult(step.step_id, [rid, "other", rid], [drafts[0], 1, 2])
    for result in (too_many, wrong, split):
        with pytest.raises(ValueError):
            scheduler.process_result(result)
    assert request.num_output_tokens == 1


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_speculative_step_in_flight_when_preempted_or_aborted(scheduling):
    """A speculative step's result that arrives after its request was preempted (or
    aborted) is discarded; the preempted request resumes and finishes with exact tokens."""
    config = make_config(scheduling=scheduling, speculative=SPEC)
    scheduler = Scheduler(config)
    kept, aborted = _requests([(8, 20, True), (9, 20, True)])
    for request in (kept, aborted):
        scheduler.add_request(request)
    by_id = {r.request_id: r for r in (kept, aborted)}
    workers = SpecWorkers(by_id, config.is_async, config.block_size)
    trace = Trace()
    collect(trace, scheduler.process_result(workers.run(scheduler.schedule())))
    step = scheduler.schedule()
    assert all(e.spec_token_ids for e in step.cached_requests)
    result = workers.run(step)
    scheduler.abort_request(aborted.request_id)
    scheduler._preempt(kept, scheduler._finished_ids)  # as _make_room does under pressure
    assert kept.status is RequestStatus.PREEMPTED and not kept.spec_token_ids
    collect(trace, scheduler.process_result(result))  # discarded: both left the step
    assert kept.num_output_tokens == 1
    assert scheduler.block_manager.num_free_blocks == config.num_blocks
    drive(scheduler, workers, 1, trace=trace)
    assert trace.outputs[kept.request_id] == expected_output(kept, config.max_model_len)
    assert scheduler.block_manager.num_free_blocks == config.num_blocks


def test_speculating_decodes_gather_into_p_micro_batches():
    """Async, P = 2: speculating requests admitted in two groups (2, then 6) end up in two
    micro-batches of R / P = 4. A group larger than that is split over consecutive steps;
    a smaller one waits, while P steps are in flight, for a smaller group in flight to
    merge with, and goes alone when there is none; a plan left empty gives its id back."""
    config = make_config(
        scheduling="async", num_stages=2, speculative=SPEC, max_num_batched_tokens=64
    )
    scheduler = Scheduler(config)
    first = [make_request(f"rep{i}", 8, 30, ignore_eos=True) for i in range(2)]
    second = [make_request(f"rep{i}", 8, 30, ignore_eos=True) for i in range(2, 8)]
    workers = SpecWorkers({r.request_id: r for r in first + second}, True, config.block_size)
    for request in first:
        scheduler.add_request(request)
    step0 = scheduler.schedule(None, 0)
    for request in second:
        scheduler.add_request(request)
    step1 = scheduler.schedule(None, 1)
    assert (step0.num_requests, step1.num_requests) == (2, 6)

    def decodes(plan):
        assert all(e.spec_token_ids for e in plan.cached_requests) and not plan.new_requests
        return sorted(e.request_id for e in plan.cached_requests)

    scheduler.process_result(workers.run(step0))
    alone = scheduler.schedule(None, 2)  # no smaller group in flight: it goes now
    assert decodes(alone) == ["rep0", "rep1"]
    scheduler.process_result(workers.run(step1))  # the 6 are back: 4 go now
    split = scheduler.schedule(None, 1)
    assert split.step_id == 3 and len(decodes(split)) == 4
    held = scheduler.schedule(None, 2)  # the other 2 wait for the 2 in flight
    assert held.num_requests == 0 and scheduler.next_step_id == held.step_id == 4
    assert scheduler.draft_candidates(2) == []

    scheduler.process_result(workers.run(alone))
    merged = scheduler.schedule(None, 1)
    assert merged.step_id == 4 and len(decodes(merged)) == 4
    assert {"rep0", "rep1"} <= set(decodes(merged))
    scheduler.process_result(workers.run(split))
    assert decodes(scheduler.schedule(None, 1)) == decodes(split), "two micro-batches of 4"


def _serve(config, requests, on_plan=None) -> tuple[Scheduler, Trace]:
    """The scheduler service's loop, steps reported in order: plan while fewer than
    `steps_in_flight` fly (an empty plan: jump to a request the pipeline rule holds, or
    wait), then take the oldest step's report. `on_plan()` runs after each plan."""
    scheduler = Scheduler(config)
    for request in requests:
        scheduler.add_request(request)
    workers = SpecWorkers({r.request_id: r for r in requests}, True, config.block_size)
    trace, in_flight = Trace(), deque()
    while scheduler.has_unfinished or in_flight:
        while len(in_flight) < config.steps_in_flight and scheduler.has_unfinished:
            plan = scheduler.schedule(None, len(in_flight))
            if on_plan is not None:
                on_plan()
            if not plan.num_requests and not plan.finished_request_ids:
                if scheduler.skip_to_next_ready(plan.step_id):
                    continue
                break
            trace.plans.append(plan)
            in_flight.append(workers.run(plan))
        collect(trace, scheduler.process_result(in_flight.popleft()))
        assert len(trace.plans) < 2000
    return scheduler, trace


def test_speculation_keeps_decodes_in_p_balanced_micro_batches_and_probes_back_off():
    """Async, P = 2, 7 requests whose outputs copy their prompts and 3 whose do not: the
    latter's k falls to 0, and they probe again after 16, then 32, then 64 tokens. Every
    step holds at most D / P decodes (so lanes stay even as requests leave speculation),
    none holds only a plain decode while speculating steps fly (it joins their next
    one), and the step ids stay consecutive meanwhile."""
    config = make_config(
        scheduling="async",
        num_stages=2,
        speculative=SPEC,
        max_model_len=256,
        num_blocks=400,
        max_num_batched_tokens=64,
        max_inflight=4,  # the output counts at which probes are seen depend on the window
    )
    copying = [make_request(f"rep{i}", 8, 200, ignore_eos=True) for i in range(7)]
    others = [make_request(f"q{i}", 9, 200, ignore_eos=True) for i in range(3)]
    requests = copying + others
    probes: dict[str, list[int]] = {r.request_id: [] for r in others}  # outputs then
    k_before = {}

    def note_probes():
        for request in others:
            if k_before.get(request.request_id) == 0 and request.num_spec_tokens:
                probes[request.request_id].append(request.num_output_tokens)
            k_before[request.request_id] = request.num_spec_tokens

    scheduler, trace = _serve(config, requests, note_probes)
    assert trace.outputs == {r.request_id: expected_output(r, 256) for r in requests}

    last_copy = max(
        i
        for i, plan in enumerate(trace.plans)
        if any(e.request_id.startswith("rep") for e in plan.cached_requests)
    )
    for i, (before, plan) in enumerate(zip(trace.plans, trace.plans[1:], strict=False)):
        decodes = [e for e in plan.cached_requests if e.num_scheduled_tokens == 1]
        assert len(decodes) <= 5, "more than D / P decodes in one step"
        # a plain (k = 0) decode's entry leaves the inputs to the stages
        if i < last_copy and decodes and all(e.num_computed_tokens is None for e in decodes):
            assert len(decodes) > 1, f"step {plan.step_id}: a plain decode alone"
        # (while the copying requests run: one speculating request left alone runs every
        # P steps, whose ids the pipeline rule skips)
        if i < last_copy and any(e.spec_token_ids for e in before.cached_requests):
            assert plan.step_id == before.step_id + 1
    for request_id, positions in probes.items():
        # a failed probe yields one token, then the request decodes 32 (then 64) without
        gaps = [b - a for a, b in zip(positions, positions[1:], strict=False)]
        assert gaps[:2] == [1 + 32, 1 + 64], (request_id, positions)


def test_speculative_config_flag_of_up_and_scheduler_names_the_mistake(capsys):
    import argparse

    from services import launcher
    from services.scheduler import cli

    up = argparse.ArgumentParser(prog="conveyor up")
    launcher.add_arguments(up)
    args = up.parse_args(["--model", "m", "--speculative-config", '{"num_speculative_tokens": 2}'])
    assert SpeculativeConfig.from_json(args.speculative_config).num_speculative_tokens == 2
    with pytest.raises(SystemExit):
        up.parse_args(
            [
                "--model",
                "m",
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 40}',
            ]
        )
    assert "num_speculative_tokens=40 is out of range" in capsys.readouterr().err
    scheduler = argparse.ArgumentParser(prog="conveyor scheduler")
    cli.add_arguments(scheduler)
    args = scheduler.parse_args(["--workers", "w:1", "--speculative-config", "ngram"])
    with pytest.raises(ConfigError, match="not valid JSON"):
        cli.build_config(args)
    args = scheduler.parse_args(["--workers", "w:1", "--speculative-config", '{"method": "ngram"}'])
    assert cli.build_config(args).speculative == SpeculativeConfig()


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_draft_model_candidates_and_proposals(scheduling):
    """The planner names the requests it may speculate for (tokens all known), takes the
    draft worker's tokens for them up to what they can keep, and a request the draft worker
    did not answer for proposes nothing and keeps its k."""
    draft = SpeculativeConfig(method="draft_model", model="/draft", num_speculative_tokens=4)
    config = make_config(
        scheduling=scheduling, num_stages=1, speculative=draft, draft_worker="127.0.0.1:1"
    )
    scheduler = Scheduler(config)
    near_end = make_request("near-end", max_tokens=3, ignore_eos=True)
    requests = [make_request("a", max_tokens=20, ignore_eos=True), near_end]
    for request in requests:
        scheduler.add_request(request)
    workers = SpecWorkers({r.request_id: r for r in requests}, config.is_async, config.block_size)
    prefill = scheduler.schedule()
    assert scheduler.draft_candidates() == [], "no candidate before its first token is known"
    scheduler.process_result(workers.run(prefill))
    candidates = {r.request_id: room for r, room in scheduler.draft_candidates()}
    assert candidates == {"a": 4, "near-end": 1}  # k, and max_tokens - outputs - 1
    step = scheduler.schedule({"a": [7, 8, 9, 10, 11], "near-end": [5, 6]})
    entries = {e.request_id: e for e in step.cached_requests}
    assert entries["a"].spec_token_ids == [7, 8, 9, 10]
    assert entries["near-end"].spec_token_ids == [5]
    assert scheduler.draft_candidates() == [], "a speculative step of theirs is in flight"
    scheduler.process_result(workers.run(step))
    k = requests[0].num_spec_tokens
    step = scheduler.schedule({})  # the draft worker did not answer
    assert [e.spec_token_ids for e in step.cached_requests] == [[]] * len(step.cached_requests)
    assert requests[0].num_spec_tokens == k
