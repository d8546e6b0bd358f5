"""A router session's outbox into responses (`RouterSession._drain`): pure, no gRPC."""

from __future__ import annotations

from services.common.proto.conveyor.v1 import scheduler_pb2
from services.scheduler.session import MAX_RESPONSE_BYTES, RouterSession, _Stream
from services.scheduler.state import TokenDelta


def test_drain_splits_at_the_size_limit_and_sends_each_update_once():
    session = RouterSession(service=None, traceparents=False)
    streams = [_Stream(session, n, f"k{n}", num_prompt_tokens=100 + n) for n in (1, 2)]
    big = list(range(60_000))  # ~180 KB a delta: several responses
    for stream in streams:  # stream 2's first delta does not fit the first response
        for offset in range(6):
            stream.put_nowait(TokenDelta(f"r{stream.stream_id}", big, offset * len(big)))
    session._enqueue(None, None, scheduler_pb2.SessionUpdate(stream_id=9, ended=True))

    responses = []
    while session._outbox:
        responses.append(session._drain())
    assert len(responses) > 1
    assert all(r.ByteSize() <= MAX_RESPONSE_BYTES for r in responses)
    updates = [u for r in responses for u in r.updates]
    assert [(u.stream_id, u.delta.offset) for u in updates[:-1]] == [
        (n, offset * len(big)) for n in (1, 2) for offset in range(6)
    ]
    assert updates[-1].stream_id == 9 and updates[-1].ended
    assert all(list(u.delta.token_ids) == big for u in updates[:-1])
    # the prompt's length goes with each stream's first delta only
    prompt_lens = [(u.stream_id, u.delta.num_prompt_tokens) for u in (updates[0], updates[6])]
    assert prompt_lens == [(1, 101), (2, 102)]
    assert not any(u.delta.num_prompt_tokens for u in updates if u.delta.offset > 0)
