"""Step planner: budgets, chunked prefill, pipeline rules, preemption, deltas, aborts."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.errors import (
    ConfigError,
    PromptTooLong,
    QueueFull,
    RequestExists,
    UnknownRequest,
)
from services.common.sampling import SamplingParams
from services.common.step import StepResult
from services.scheduler.config import PipelineInfo, SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from tests.scheduler.utils import (
    FakeWorkers,
    Trace,
    drive,
    expected_output,
    fake_token,
    make_config,
    make_request,
)

SHARED_PREFIX = [500 + i for i in range(24)]


def _run(config, requests, result_delay, scheduler=None):
    scheduler = scheduler or Scheduler(config)
    for request in requests:
        scheduler.add_request(request)
    workers = FakeWorkers(config.is_async, config.block_size)
    trace = drive(scheduler, workers, result_delay)
    return scheduler, workers, trace


def _check_plans(config, trace: Trace, workers_sampled: dict[int, set[str]]) -> None:
    processed_before = {result_step: planned for planned, result_step in trace.process_steps}
    last_sample: dict[str, int] = {}
    for plan in trace.plans:
        ids = [r.request_id for r in plan.new_requests + plan.cached_requests]
        assert len(ids) == len(set(ids)), "a request twice in one step"
        assert len(ids) <= config.max_num_seqs
        assert plan.num_scheduled_tokens <= config.max_num_batched_tokens
        for request_id in ids:
            sampled_at = last_sample.get(request_id)
            if sampled_at is not None:
                # Pipeline rule: never in two in-flight steps.
                assert plan.step_id >= sampled_at + config.num_stages
                if not config.is_async:  # sync: its token came back first
                    assert processed_before.get(sampled_at, 1 << 60) <= plan.step_id
            if request_id in workers_sampled.get(plan.step_id, ()):
                last_sample[request_id] = plan.step_id
        for request_id in plan.finished_request_ids:
            last_sample.pop(request_id, None)


def _sampled_by_step(trace: Trace, workers: FakeWorkers) -> dict[int, set[str]]:
    # Recompute which request sampled at which step from the plans (workers are replayed).
    replay = FakeWorkers(workers.is_async, workers.block_size)
    return {plan.step_id: set(replay.run(plan).request_ids) for plan in trace.plans}


def _check_coverage(trace: Trace, workers: FakeWorkers, requests: list[Request]) -> None:
    # Requests never preempted: every prompt token past the cache hit computed exactly once.
    admitted = {}
    for plan in trace.plans:
        for new in plan.new_requests:
            admitted.setdefault(new.request_id, []).append(new.num_computed_tokens)
    for request in requests:
        hits = admitted[request.request_id]
        if len(hits) > 1:
            continue
        positions = [
            p for start, end in workers.computed[request.request_id] for p in range(start, end)
        ]
        prompt_positions = [p for p in positions if p < request.num_prompt_tokens]
        assert prompt_positions == list(range(hits[0], request.num_prompt_tokens))


@st.composite
def workloads(draw):
    num_stages = draw(st.integers(1, 4))
    scheduling = draw(st.sampled_from(["async", "sync"]))
    chunked = draw(st.booleans())
    block_size = draw(st.sampled_from([2, 4, 8]))
    max_model_len = 64
    config = make_config(
        num_stages=num_stages,
        scheduling=scheduling,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        block_size=block_size,
        num_blocks=draw(st.integers(max_model_len // block_size, 80)),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 40)) if chunked else max_model_len,
        max_model_len=max_model_len,
        policy=draw(st.sampled_from(["fcfs", "priority", "fair"])),
    )
    specs = draw(
        st.lists(
            st.tuples(st.integers(1, 40), st.integers(1, 20), st.booleans(), st.integers(0, 2)),
            min_size=1,
            max_size=10,
        )
    )
    requests = []
    for i, (prompt_len, max_tokens, shared, priority) in enumerate(specs):
        prompt = None
        if shared:
            prompt = SHARED_PREFIX[: min(prompt_len, 20)] + [i % 3] * max(0, prompt_len - 20)
        requests.append(
            make_request(
                f"q{i}",
                prompt_len,
                max_tokens,
                prompt=prompt,
                priority=priority,
                tenant=f"t{i % 2}",
                arrival_time=float(i),
            )
        )
    delay = draw(st.integers(num_stages, num_stages + 2))
    return config, requests, delay


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_schedule_random_workloads_keep_every_rule_and_produce_exact_outputs(workload):
    config, requests, delay = workload
    expected = {r.request_id: expected_output(r, config.max_model_len) for r in requests}
    scheduler, workers, trace = _run(config, requests, delay)
    assert not scheduler.has_unfinished, "some request never finished"
    assert trace.outputs == expected
    _check_plans(config, trace, _sampled_by_step(trace, workers))
    _check_coverage(trace, workers, requests)
    assert scheduler.block_manager.num_free_blocks == config.num_blocks


class _ScanningScheduler(Scheduler):
    """The planner without its index of who is due: every plan looks at every running
    request (what `schedule` did before the index; the reference it must match)."""

    def _take_due(self, step_id):
        return [(r.run_seq, r) for r in self.running.values() if r.next_step_id <= step_id]

    def _num_decoding(self):
        return sum(r.num_computed_tokens >= r.num_prompt_tokens - 1 for r in self.running.values())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.lists(st.tuples(st.integers(0, 60), st.integers(0, 9)), max_size=4))
def test_schedule_index_of_due_requests_makes_the_plans_a_full_scan_makes(workload, aborts):
    """Running requests are kept by the step they are due in, so that a plan looks at
    those (1 in P) rather than at all: the plans must be those of a scan of all, through
    preemptions and aborts, in both modes."""
    config, requests, delay = workload
    traces = []
    for cls in (Scheduler, _ScanningScheduler):
        scheduler = cls(config)
        aborts_at = {step: f"q{i}" for step, i in aborts}

        def abort(plan, scheduler=scheduler, aborts_at=aborts_at):
            request_id = aborts_at.get(plan.step_id)
            if request_id in scheduler.requests:
                scheduler.abort_request(request_id)

        for request in requests:
            scheduler.add_request(
                make_request(
                    request.request_id,
                    request.num_prompt_tokens,
                    request.sampling.max_tokens,
                    prompt=list(request.prompt_token_ids),
                    priority=request.priority,
                    tenant=request.tenant,
                    arrival_time=request.arrival_time,
                )
            )
        workers = FakeWorkers(config.is_async, config.block_size)
        traces.append(drive(scheduler, workers, delay, on_step=abort))
        assert not scheduler.has_unfinished
    indexed, scanned = traces
    assert indexed.plans == scanned.plans
    assert indexed.outputs == scanned.outputs


@pytest.mark.parametrize("scheduling", ["async", "sync"])
def test_schedule_preemption_under_a_tiny_pool_still_finishes_every_request(scheduling):
    config = make_config(
        num_blocks=8,
        block_size=4,
        max_model_len=32,
        max_num_seqs=8,
        scheduling=scheduling,
        num_stages=2,
    )
    requests = [make_request(f"r{i}", 10, 12, ignore_eos=True, priority=i % 3) for i in range(10)]
    expected = {r.request_id: expected_output(r, config.max_model_len) for r in requests}
    scheduler, _, trace = _run(config, requests, result_delay=3)
    assert scheduler.num_preemptions > 0
    assert trace.outputs == expected
    resent = [
        n
        for plan in trace.plans
        for n in plan.new_requests
        if n.num_prompt_tokens < len(n.token_ids)
    ]
    assert resent, "a preempted request comes back with prompt + outputs so far"
    assert scheduler.block_manager.num_free_blocks == config.num_blocks


def test_schedule_pipeline_spacing_async_and_sync():
    for scheduling, delay, expected_steps in (
        ("async", 5, [0, 4, 8, 12]),  # planned at s + P before its token is back
        ("sync", 6, [0, 6, 12, 18]),  # waits for the token (late here)
    ):
        config = make_config(num_stages=4, scheduling=scheduling)
        request = make_request("r", 6, 4, ignore_eos=True)
        _, _, trace = _run(config, [request], delay)
        steps = [p.step_id for p in trace.plans if p.num_requests]
        assert steps == expected_steps, scheduling


def test_schedule_async_evens_the_micro_batches():
    """Async, P = 2: 10 requests that max_num_seqs admits 7, then 3, decode in two
    micro-batches of 5, not 7 and 3: a step takes at most ceil(D / P) decodes, and a
    request it leaves out runs in the next step (the other lane)."""
    config = make_config(
        scheduling="async", num_stages=2, max_num_seqs=7, max_num_batched_tokens=128
    )
    requests = [make_request(f"r{i}", 10, 12, ignore_eos=True) for i in range(10)]
    _, _, trace = _run(config, requests, 2)
    assert [len(p.new_requests) for p in trace.plans[:2]] == [7, 3]
    decodes = [len(p.cached_requests) for p in trace.plans[2:12]]
    assert max(decodes) == 5 and decodes[-4:] == [5, 5, 5, 5], decodes
    assert trace.outputs == {r.request_id: expected_output(r, 128) for r in requests}


def test_schedule_chunks_a_long_prompt_in_consecutive_steps():
    config = make_config(max_num_batched_tokens=8, num_stages=3, max_model_len=64)
    _, _, trace = _run(config, [make_request("r", 30, 2, ignore_eos=True)], result_delay=3)
    chunks = [(p.step_id, p.num_scheduled_tokens) for p in trace.plans if p.num_requests]
    assert chunks[:4] == [(0, 8), (1, 8), (2, 8), (3, 6)]
    assert chunks[4] == (6, 1)  # first decode: 3 steps after the step that sampled


def test_schedule_decodes_go_before_new_prefills():
    config = make_config(max_num_batched_tokens=10, max_num_seqs=8)
    scheduler = Scheduler(config)
    for i in range(3):
        scheduler.add_request(make_request(f"d{i}", 3, 20, ignore_eos=True))
    scheduler.process_result(StepResult(0, *_sampled(scheduler.schedule())))
    scheduler.add_request(make_request("long", 40, 2))
    plan = scheduler.schedule()
    assert [r.num_scheduled_tokens for r in plan.cached_requests] == [1, 1, 1]
    assert [(r.request_id, r.num_scheduled_tokens) for r in plan.new_requests] == [("long", 7)]


def _sampled(plan):
    ids = [r.request_id for r in plan.new_requests + plan.cached_requests]
    return ids, [fake_token(i, 0) for i in ids]


def test_schedule_prefix_cache_hit_is_not_recomputed():
    config = make_config(block_size=4)
    prompt = list(range(100, 122))  # 22 tokens: 5 full blocks
    scheduler, _, trace = _run(config, [make_request("a", prompt=prompt, max_tokens=2)], 1)
    scheduler.add_request(make_request("b", prompt=prompt, max_tokens=2))
    plan = scheduler.schedule()
    assert plan.new_requests[0].num_computed_tokens == 20
    assert plan.new_requests[0].num_scheduled_tokens == 2
    assert scheduler.block_manager.stats().prefix_hit_rate == pytest.approx(20 / 44)


def test_schedule_async_discards_the_token_of_a_request_found_finished_late():
    prompt_len = 5
    stop = fake_token("r", prompt_len)  # the first sampled token stops the request
    request = Request(
        "r", list(range(prompt_len)), SamplingParams(max_tokens=10, stop_token_ids=[stop])
    )
    config = make_config(num_stages=2, scheduling="async")
    scheduler, _, trace = _run(config, [request], result_delay=3)
    decodes = [p.step_id for p in trace.plans if p.cached_requests]
    assert decodes == [2]  # planned optimistically before the stop token came back
    assert trace.outputs == {"r": [stop]} and trace.finish_reasons == {"r": "stop"}
    assert any("r" in p.finished_request_ids for p in trace.plans)
    assert scheduler.block_manager.num_free_blocks == config.num_blocks


def test_schedule_abort_waiting_and_running_requests():
    config = make_config(max_num_seqs=1, num_stages=2)
    scheduler = Scheduler(config)
    scheduler.add_request(make_request("run", 4, 10))
    scheduler.add_request(make_request("wait", 4, 10))
    plan = scheduler.schedule()
    scheduler.abort_request("wait")
    scheduler.abort_request("run")  # in flight
    assert scheduler.process_result(StepResult(plan.step_id, *_sampled(plan))) == []
    nxt = scheduler.schedule()
    assert nxt.finished_request_ids == ["run"] and nxt.num_requests == 0
    assert scheduler.block_manager.num_free_blocks == config.num_blocks
    with pytest.raises(UnknownRequest, match="not running or waiting"):
        scheduler.abort_request("run")


def test_schedule_rejects_what_cannot_be_served():
    scheduler = Scheduler(make_config(max_waiting=2, max_model_len=16, num_blocks=8))
    with pytest.raises(PromptTooLong, match="max_model_len=16"):
        scheduler.add_request(make_request("long", 16))
    scheduler.add_request(make_request("a"))
    scheduler.add_request(make_request("b"))
    with pytest.raises(QueueFull, match="max_waiting=2"):
        scheduler.add_request(make_request("c"))
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        make_config(num_blocks=3, block_size=4, max_model_len=16)


def test_schedule_sync_sends_sampled_tokens_and_async_does_not():
    for scheduling in ("sync", "async"):
        scheduler = Scheduler(make_config(scheduling=scheduling))
        scheduler.add_request(make_request("r", 4, 5, ignore_eos=True))
        plan = scheduler.schedule()
        scheduler.process_result(StepResult(plan.step_id, ["r"], [42]))
        cached = scheduler.schedule().cached_requests[0]
        assert cached.new_token_ids == ([42] if scheduling == "sync" else [])


@pytest.mark.parametrize("scheduling", ["async", "sync"])
def test_schedule_requeue_running_after_pipeline_loss_finishes_with_exact_outputs(scheduling):
    config = make_config(num_stages=2, scheduling=scheduling, max_num_seqs=4)
    requests = [make_request(f"r{i}", 5 + i, 12, ignore_eos=True) for i in range(6)]
    expected = {r.request_id: expected_output(r, config.max_model_len) for r in requests}
    scheduler = Scheduler(config)
    for request in requests:
        scheduler.add_request(request)
    trace = drive(scheduler, FakeWorkers(config.is_async, config.block_size), 3, max_steps=10)
    assert scheduler.running and any(trace.outputs.values())
    scheduler.requeue_running()  # the old workers and their in-flight steps are gone
    assert not scheduler.running and scheduler.block_manager.num_free_blocks == config.num_blocks
    drive(scheduler, FakeWorkers(config.is_async, config.block_size), 3, trace=trace)
    assert trace.outputs == expected


@pytest.mark.parametrize("scheduling", ["async", "sync"])
def test_schedule_requeue_running_admits_again_at_once(scheduling):
    """Nothing of the lost session is in flight: the next plan takes the requests back, it
    does not wait out the old session's pipeline spacing (nothing else would wake it)."""
    config = make_config(num_stages=3, scheduling=scheduling, max_num_seqs=4)
    scheduler = Scheduler(config)
    for i in range(2):
        scheduler.add_request(make_request(f"r{i}", 5, 12, ignore_eos=True))
    plan = scheduler.schedule()
    assert len(plan.new_requests) == 2
    scheduler.requeue_running()
    again = scheduler.schedule()
    assert sorted(r.request_id for r in again.new_requests) == ["r0", "r1"]


def test_add_request_duplicate_id_is_refused_and_keeps_the_first():
    scheduler = Scheduler(make_config())
    scheduler.add_request(make_request("dup", 5, 4))
    with pytest.raises(RequestExists, match="dup"):
        scheduler.add_request(make_request("dup", 7, 4))
    assert scheduler.requests["dup"].num_prompt_tokens == 5


def _budget(device: str, chunked: bool = True, flag: int | None = None) -> int:
    info = PipelineInfo(2, 1024, 16, 8192, 64, "m", [2], device=device)
    config = SchedulerConfig(enable_chunked_prefill=chunked, max_num_batched_tokens=flag)
    return config.resolved(info).max_num_batched_tokens


def test_default_step_budget_follows_the_stages_device():
    assert _budget("cpu") == 512
    assert _budget("cuda") == 2048
    assert _budget("tpu") == 2048  # unknown: the GPU default
    assert _budget("cpu", chunked=False) == 8192  # unchunked: a prompt per step
    assert _budget("cpu", flag=100) == 100


def test_config_resolved_takes_the_workers_geometry_and_refuses_a_contradiction():
    info = PipelineInfo(3, 1024, 16, 4096, 64, "m", [2], device="cpu")
    resolved = SchedulerConfig(max_model_len=1024).resolved(info)
    assert (resolved.num_blocks, resolved.block_size, resolved.num_stages) == (1024, 16, 3)
    assert resolved.max_model_len == 1024  # a flag may lower the workers' context
    assert SchedulerConfig(max_model_len=10**6).resolved(info).max_model_len == 4096
    with pytest.raises(ConfigError, match="--block-size=32 but the workers use 16"):
        SchedulerConfig(block_size=32).resolved(info)
    with pytest.raises(ConfigError, match="resolve the config"):
        Scheduler(SchedulerConfig())
