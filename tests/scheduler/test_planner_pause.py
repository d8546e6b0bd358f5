"""Pausing the planner, recomputing after a weight update, and the prefix cache's epochs."""

from __future__ import annotations

import pytest

from services.scheduler.block_manager import BlockManager
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import PauseMode, Scheduler
from tests.scheduler.utils import FakeWorkers, drive, expected_output, make_config, make_request

PAUSE_AT, UNPAUSE_AT = 6, 20


def _paused_window(scheduler: Scheduler, mode: PauseMode, late_request=None):
    """on_step for `drive`: pauses after step PAUSE_AT (adding `late_request` then), unpauses
    after UNPAUSE_AT; records the plans made while paused."""
    paused_plans = []

    def on_step(plan):
        if scheduler.pause_mode is not None:
            paused_plans.append(plan)
        if plan.step_id == PAUSE_AT:
            scheduler.pause_mode = mode
            if late_request is not None:
                scheduler.add_request(late_request)
        elif plan.step_id == UNPAUSE_AT:
            scheduler.pause_mode = None

    return on_step, paused_plans


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_pause_keep_plans_nothing_and_outputs_are_unchanged(scheduling):
    config = make_config(scheduling=scheduling, num_stages=2)
    scheduler = Scheduler(config)
    requests = [make_request(f"r{i}", max_tokens=12, ignore_eos=True) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    late = make_request("late", max_tokens=4, ignore_eos=True)
    on_step, paused_plans = _paused_window(scheduler, PauseMode.KEEP, late)
    trace = drive(scheduler, FakeWorkers(config.is_async, config.block_size), 2, on_step=on_step)
    assert paused_plans and all(p.num_requests == 0 for p in paused_plans)
    for request in [*requests, late]:
        assert trace.outputs[request.request_id] == expected_output(request, config.max_model_len)


def test_pause_wait_runs_running_requests_and_admits_none():
    config = make_config(scheduling="async", num_stages=2)
    scheduler = Scheduler(config)
    running = make_request("running", max_tokens=30, ignore_eos=True)
    scheduler.add_request(running)
    late = make_request("late", max_tokens=4, ignore_eos=True)
    on_step, paused_plans = _paused_window(scheduler, PauseMode.WAIT, late)
    trace = drive(scheduler, FakeWorkers(True, config.block_size), 2, on_step=on_step)
    planned = {r.request_id for p in paused_plans for r in (*p.new_requests, *p.cached_requests)}
    assert planned == {"running"}, "WAIT plans the running request only"
    assert trace.outputs["late"] == expected_output(late, config.max_model_len)


def test_recompute_running_preempts_every_running_request_and_outputs_are_unchanged():
    config = make_config(scheduling="async", num_stages=2)
    scheduler = Scheduler(config)
    requests = [make_request(f"r{i}", max_tokens=12, ignore_eos=True) for i in range(2)]
    for request in requests:
        scheduler.add_request(request)
    recomputed = []

    def on_step(plan):
        if plan.step_id == PAUSE_AT:
            recomputed.append(scheduler.recompute_running())

    trace = drive(scheduler, FakeWorkers(True, config.block_size), 1, on_step=on_step)
    assert recomputed == [2]
    assert all(r.num_preemptions == 1 and r.status is not RequestStatus.RUNNING for r in requests)
    for request in requests:
        assert trace.outputs[request.request_id] == expected_output(request, config.max_model_len)


def test_invalidate_prefix_cache_hides_blocks_cached_before():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(100, 113))  # 3 full blocks + 1
    bm.allocate("a", len(tokens))
    bm.cache_full_blocks("a", tokens, len(tokens))
    assert bm.find_cached_prefix(tokens).num_tokens(4) == 12
    bm.invalidate_prefix_cache()
    assert bm.find_cached_prefix(tokens).num_tokens(4) == 0
    bm.allocate("b", len(tokens))  # computed again under the new weights, cached again
    bm.cache_full_blocks("b", tokens, len(tokens))
    assert bm.find_cached_prefix(tokens).block_ids == bm.block_table("b")[:3]
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8
