"""Metrics, spans, the event trace and `conveyor stats` of a real stack, checked against the
requests the test sent (each test uses its own request ids, so the order does not matter)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from services.client.client import ConveyorClient, collect
from tests.observability.utils import ROOT, read_jsonl, value, wait_for

pytestmark = pytest.mark.slow

PROMPTS = ["the quick brown fox", "pipeline parallel serving", "hello there", "a b c d e f"]


def run_requests(stack, tag: str, num_length: int, num_aborted: int = 0) -> dict:
    """`num_length` requests that finish by length, `num_aborted` cancelled after their
    first output; returns {request id: (tokens streamed, usage or None, finish reason,
    messages that carried tokens)}."""
    seen = {}
    with ConveyorClient(stack.router, timeout_s=120) as client:
        for i in range(num_length):
            rid = f"{tag}-len-{i}"
            deltas = list(
                client.generate(
                    PROMPTS[i % len(PROMPTS)], max_tokens=8, ignore_eos=True, request_id=rid
                )
            )
            result = collect(deltas)
            with_tokens = sum(1 for d in deltas if d.token_ids)
            seen[rid] = (len(result.token_ids), result.usage, result.finish_reason, with_tokens)
        for i in range(num_aborted):
            rid = f"{tag}-abort-{i}"
            stream = client.generate(PROMPTS[0], max_tokens=1500, ignore_eos=True, request_id=rid)
            first = next(stream)
            stream.close()  # cancels the call: the router aborts the request
            seen[rid] = (len(first.token_ids), None, "abort", 1)
    return seen


def test_metrics_endpoints_match_the_run(observed_stack):
    stack = observed_stack
    before = {"router": stack.scrape("router"), "scheduler": stack.scrape("scheduler")}
    seen = run_requests(stack, f"m{uuid.uuid4().hex[:6]}", num_length=4, num_aborted=1)
    finished = [v for v in seen.values() if v[2] == "length"]

    def router_settled():
        after = stack.scrape("router")
        aborted = value(
            after, "conveyor:request_success_total", model_name="tiny", finished_reason="abort"
        ) - value(
            before["router"],
            "conveyor:request_success_total",
            model_name="tiny",
            finished_reason="abort",
        )
        return after if aborted >= 1 else None

    router = wait_for(router_settled)

    def delta(name, **labels):
        return value(router, name, **labels) - value(before["router"], name, **labels)

    model = {"model_name": "tiny"}
    assert delta("conveyor:request_success_total", finished_reason="length", **model) == 4
    assert delta("conveyor:request_success_total", finished_reason="abort", **model) == 1
    # The router counts every token it streamed; of the aborted stream the client read only
    # the first message, and more may have been on the wire when it hung up.
    finished_tokens = sum(v[0] for v in finished)
    aborted_read = sum(v[0] for v in seen.values() if v[2] == "abort")
    generated = delta("conveyor:generation_tokens_total", **model)
    assert finished_tokens == 4 * 8
    assert finished_tokens + aborted_read <= generated <= finished_tokens + 1500
    assert delta("conveyor:prompt_tokens_total", **model) >= sum(
        v[1]["prompt_tokens"] for v in finished
    )
    assert delta("conveyor:time_to_first_token_seconds_count", **model) == 5
    assert delta("conveyor:e2e_request_latency_seconds_count", **model) == 5
    # One observation per streamed message after a request's first: a message may carry two
    # tokens (the router streams what it has), so the count is the messages', not 4 x 7.
    intervals = sum(v[3] - 1 for v in finished)
    itl_count = delta("conveyor:inter_token_latency_seconds_count", **model)
    assert intervals <= itl_count <= intervals + 1500

    scheduler = wait_for(
        lambda: (
            (s := stack.scrape("scheduler"))
            and value(s, "conveyor:num_requests_running") == 0
            and s
        )
    )
    queued = value(scheduler, "conveyor:request_queue_time_seconds_count") - value(
        before["scheduler"], "conveyor:request_queue_time_seconds_count"
    )
    assert queued == 5
    assert value(scheduler, "conveyor:redis_round_trip_seconds_count") > 0
    assert 0.0 <= value(scheduler, "conveyor:kv_cache_usage_perc") <= 1.0
    assert value(scheduler, "conveyor:num_requests_waiting") == 0
    assert value(scheduler, "conveyor:scheduler_steps_total") > 0
    hits = value(scheduler, "conveyor:prefix_cache_hits_total")
    assert 0 <= hits <= value(scheduler, "conveyor:prefix_cache_queries_total")

    for stage in range(stack.num_stages):
        worker = stack.scrape("worker", stage)
        label = {"stage": str(stage)}
        assert value(worker, "conveyor:stage_step_seconds_count", **label) > 0
        assert value(worker, "conveyor:stage_batch_size_count", **label) > 0
        bubble = value(worker, "conveyor:pipeline_bubble_fraction", **label)
        assert 0.0 <= bubble <= 1.0
        assert ("conveyor:pipeline_bubble_fraction", (("stage", str(stage)),)) in worker
        plan_wait = value(worker, "conveyor:pipeline_plan_wait_fraction", **label)
        assert 0.0 <= plan_wait <= bubble + 1e-9


def test_one_request_is_one_trace_across_processes(observed_stack):
    stack = observed_stack
    rid = f"trace-{uuid.uuid4().hex[:8]}"
    with ConveyorClient(stack.router, timeout_s=120) as client:
        client.complete("trace me", max_tokens=4, ignore_eos=True, request_id=rid)

    def router_span():
        spans = read_jsonl(stack.spans_path)
        return next(
            (
                s
                for s in spans
                if s["name"] == "conveyor.router.generate"
                and s["attributes"].get("conveyor.request_id") == rid
            ),
            None,
        )

    root = wait_for(router_span)

    def whole_trace():
        spans = [s for s in read_jsonl(stack.spans_path) if s["trace_id"] == root["trace_id"]]
        stages = {
            s["attributes"]["conveyor.stage"] for s in spans if s["name"] == "conveyor.worker.step"
        }
        names = {s["name"] for s in spans}
        if stages == set(range(stack.num_stages)) and "conveyor.scheduler.request" in names:
            return spans
        return None

    spans = wait_for(whole_trace)
    assert root["parent_span_id"] is None
    assert {s["service"] for s in spans} == {
        "conveyor-router",
        "conveyor-scheduler",
        "conveyor-worker",
    }
    (request,) = [s for s in spans if s["name"] == "conveyor.scheduler.request"]
    (queue,) = [s for s in spans if s["name"] == "conveyor.scheduler.queue"]
    steps = [s for s in spans if s["name"] == "conveyor.worker.step"]
    assert request["parent_span_id"] == root["span_id"]
    assert request["attributes"]["conveyor.finish_reason"] == "length"
    assert queue["parent_span_id"] == request["span_id"]
    assert all(s["parent_span_id"] == request["span_id"] for s in steps)
    # the scheduler names a request in its principal's namespace (docs/security.md)
    assert all(f"anonymous/{rid}" in s["attributes"]["conveyor.request_ids"] for s in steps)
    # 4 tokens: a prefill and 3 decodes, each run by every stage
    step_events = [e for e in request["events"] if e["name"] == "step"]
    assert len(step_events) == 4
    assert len(steps) == 4 * stack.num_stages
    assert root["start_ns"] <= request["start_ns"] <= request["end_ns"] <= root["end_ns"]


def test_event_trace_replays_the_finish_reasons(observed_stack):
    stack = observed_stack
    tag = f"e{uuid.uuid4().hex[:6]}"
    seen = run_requests(stack, tag, num_length=3, num_aborted=1)

    def transitions():
        events = [
            e
            for e in read_jsonl(stack.events_path)
            if e["event"] == "transition" and e["request_id"].startswith(f"anonymous/{tag}")
        ]
        finals = [e for e in events if e["to"].startswith("finished")]
        return events if len(finals) == len(seen) else None

    events = wait_for(transitions)
    finals = sorted(e["to"] for e in events if e["to"].startswith("finished"))
    assert finals == ["finished_aborted"] + ["finished_length"] * 3
    keys = {f"anonymous/{rid}" for rid in seen}  # the scheduler's ids: principal/request id
    for key in keys:  # each request's transitions chain: from = the previous to
        chain = [e for e in events if e["request_id"] == key]
        assert chain[0]["from"] is None and chain[0]["to"] == "waiting"
        for prev, cur in zip(chain, chain[1:], strict=False):
            assert cur["from"] == prev["to"]
    steps = [e for e in read_jsonl(stack.events_path) if e["event"] == "step"]
    planned = {rid for e in steps for rid in e["request_ids"]}
    assert keys <= planned
    for e in steps:
        assert len(e["num_tokens"]) == len(e["request_ids"]) == e["num_new"] + e["num_cached"]
    text = stack.events_path.read_text()
    assert "token_ids" not in text and PROMPTS[0] not in text


def stats(stack, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "stats", "--server", stack.scheduler, *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_stats_json_is_consistent_with_the_scheduler(observed_stack):
    stack = observed_stack
    run_requests(stack, f"s{uuid.uuid4().hex[:6]}", num_length=2)
    wait_for(lambda: value(stack.scrape("scheduler"), "conveyor:num_requests_running") == 0)
    reply = stats(stack, "--json")
    assert reply.returncode == 0, reply.stdout + reply.stderr
    numbers = json.loads(reply.stdout)
    metrics = stack.scrape("scheduler")
    assert numbers["serving"] and numbers["num_stages"] == stack.num_stages
    assert numbers["num_used_blocks"] + numbers["num_free_blocks"] == numbers["num_blocks"] > 0
    assert numbers["num_running"] == 0 and numbers["top_requests"] == []
    assert numbers["kv_usage"] == pytest.approx(value(metrics, "conveyor:kv_cache_usage_perc"))
    assert numbers["num_steps"] == value(metrics, "conveyor:scheduler_steps_total")
    assert numbers["num_free_blocks"] == value(metrics, "conveyor:kv_cache_free_blocks")
    assert len(numbers["bubble_fraction"]) == stack.num_stages
    assert all(0.0 <= b <= 1.0 for b in numbers["bubble_fraction"])
    waits = numbers["plan_wait_fraction"]  # a part of each stage's bubble
    assert len(waits) == stack.num_stages
    assert all(0.0 <= w <= b + 1e-9 for w, b in zip(waits, numbers["bubble_fraction"], strict=True))

    table = stats(stack)
    assert table.returncode == 0 and "KV blocks" in table.stdout and "bubble" in table.stdout
    assert "plan wait" in table.stdout


def test_stats_watch_refreshes(observed_stack):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "stats",
            "--server",
            observed_stack.scheduler,
            "--json",
            "--watch",
            "0.2",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert all(json.loads(line)["num_blocks"] > 0 for line in lines)


def test_stats_names_an_unreachable_server():
    from tests.conftest import free_port

    reply = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "stats",
            "--server",
            f"127.0.0.1:{free_port()}",
            "--timeout",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert reply.returncode == 1 and "UNAVAILABLE" in reply.stdout
