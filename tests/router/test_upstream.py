"""A scheduler's TokenDelta as the router's relay takes it (services/router/upstream.py)."""

from __future__ import annotations

import pytest

from services.common.errors import RequestFailed
from services.common.proto.conveyor.v1 import common_pb2, scheduler_pb2
from services.router.upstream import delta_from_pb


def test_tokens_already_delivered_are_dropped():
    msg = scheduler_pb2.TokenDelta(token_ids=[5, 6, 7], offset=2)
    delta = delta_from_pb(msg, 3)
    assert (delta.offset, delta.token_ids, delta.finish_reason) == (3, [6, 7], None)


def test_a_gap_before_tokens_or_a_finish_fails_the_request():
    with pytest.raises(RequestFailed, match="skipped tokens 3..4"):
        delta_from_pb(scheduler_pb2.TokenDelta(token_ids=[9], offset=5), 3)
    finish = scheduler_pb2.TokenDelta(offset=5, finish_reason=common_pb2.FINISH_REASON_LENGTH)
    with pytest.raises(RequestFailed, match="skipped tokens 3..4"):
        delta_from_pb(finish, 3)


def test_a_move_without_tokens_stays_where_the_stream_is():
    """A scheduler letting go of a request another pipeline adopted counts tokens the store
    refused, which it never streamed: the stream resumes from what it delivered."""
    msg = scheduler_pb2.TokenDelta(offset=10, owner_pipeline_id="p0")
    delta = delta_from_pb(msg, 2)
    assert (delta.offset, delta.token_ids, delta.finish_reason) == (2, [], None)
