"""Plans through their messages: plain decodes travel as columns, the rest as entries."""

from __future__ import annotations

import pytest

from services.common.pb import plan_from_pb, plan_to_pb
from services.common.proto.conveyor.v1 import worker_pb2
from services.common.sampling import SamplingParams
from services.common.step import CachedRequest, NewRequest, StepPlan


def _plan(is_async: bool) -> StepPlan:
    token = [] if is_async else [11]
    return StepPlan(
        step_id=9,
        new_requests=[NewRequest("n", [1, 2, 3], 3, SamplingParams(), [4], 0, 3)],
        cached_requests=[
            CachedRequest("d1", 1, [], list(token)),
            CachedRequest("block", 1, [5], list(token)),  # a decode that opens a block
            CachedRequest("d2", 1, [], list(token)),
            CachedRequest("chunk", 16, [6], []),  # a prefill chunk
            CachedRequest("spec", 1, [], list(token), spec_token_ids=[8, 9]),
            CachedRequest("rollback", 1, [], [12, 13], num_computed_tokens=40),
        ],
        finished_request_ids=["gone"],
    )


@pytest.mark.parametrize("is_async", [True, False])
def test_plan_round_trips_with_plain_decodes_as_columns(is_async):
    plan = _plan(is_async)
    msg = worker_pb2.StepPlan.FromString(plan_to_pb(plan, is_async).SerializeToString())
    assert list(msg.decode_request_ids) == ["d1", "d2"]
    assert list(msg.decode_token_ids) == ([] if is_async else [11, 11])
    assert [r.request_id for r in msg.cached_requests] == ["block", "chunk", "spec", "rollback"]
    back = plan_from_pb(msg)
    # the same requests with the same fields; the columns' decodes run after the entries
    key = {r.request_id: r for r in plan.cached_requests}
    assert [r.request_id for r in back.cached_requests] == [
        "block",
        "chunk",
        "spec",
        "rollback",
        "d1",
        "d2",
    ]
    assert all(r == key[r.request_id] for r in back.cached_requests)
    assert back.new_requests == plan.new_requests
    assert back.finished_request_ids == ["gone"]


def test_plan_from_pb_refuses_decode_columns_of_different_lengths():
    msg = worker_pb2.StepPlan(step_id=1, decode_request_ids=["a", "b"], decode_token_ids=[7])
    with pytest.raises(ValueError, match="1 decode_token_ids for 2 decode_request_ids"):
        plan_from_pb(msg)
