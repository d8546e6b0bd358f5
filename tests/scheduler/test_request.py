"""Request states and stop conditions."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidRequest
from services.common.sampling import SamplingParams
from services.scheduler.request import InvalidTransition, Request, RequestStatus

S = RequestStatus


def test_request_transition_follows_the_state_machine():
    request = Request("r", [1, 2])
    for status in (S.RUNNING, S.PREEMPTED, S.RUNNING, S.FINISHED_STOPPED):
        request.transition(status)
    assert request.is_finished and request.status.finish_reason == "stop"


@pytest.mark.parametrize(
    "path",
    [
        [S.FINISHED_STOPPED, S.RUNNING],  # finished is final
        [S.RUNNING, S.WAITING],
        [S.PREEMPTED],  # only a running request is preempted
        [S.FINISHED_ABORTED, S.FINISHED_ABORTED],
    ],
)
def test_request_transition_rejects_illegal_moves(path):
    request = Request("r", [1])
    with pytest.raises(InvalidTransition, match="cannot go from"):
        for status in path:
            request.transition(status)


def test_request_failed_keeps_its_reason():
    request = Request("r", [1])
    request.transition(S.FAILED, "worker rejected the prompt")
    assert request.fail_reason == "worker rejected the prompt"
    assert request.status.finish_reason == "error"


def _running(sampling: SamplingParams, eos: tuple[int, ...] = (2,), prompt_len: int = 3) -> Request:
    request = Request("r", list(range(10, 10 + prompt_len)), sampling, eos_token_ids=eos)
    request.transition(S.RUNNING)
    return request


def test_request_stops_on_eos_unless_ignored():
    request = _running(SamplingParams(max_tokens=10))
    request.append_output(2)
    assert request.check_stop(100) is S.FINISHED_STOPPED
    request = _running(SamplingParams(max_tokens=10, ignore_eos=True))
    request.append_output(2)
    assert request.check_stop(100) is None


def test_request_stops_on_any_of_several_eos_ids():
    # Llama 3 Instruct: <|end_of_text|> and <|eot_id|> both end a turn.
    for eos in (128001, 128009):
        request = _running(SamplingParams(max_tokens=10), eos=(128001, 128009))
        request.append_output(7)
        assert request.check_stop(100) is None
        request.append_output(eos)
        assert request.check_stop(100) is S.FINISHED_STOPPED


def test_request_stops_on_stop_token_ids_and_lengths():
    request = _running(SamplingParams(max_tokens=3, stop_token_ids=[5]))
    request.append_output(4)
    assert request.check_stop(100) is None
    request.append_output(5)
    assert request.check_stop(100) is S.FINISHED_STOPPED
    request = _running(SamplingParams(max_tokens=2))
    request.append_output(4)
    request.append_output(4)
    assert request.check_stop(100) is S.FINISHED_LENGTH
    request = _running(SamplingParams(max_tokens=50), prompt_len=4)
    request.append_output(4)
    assert request.check_stop(5) is S.FINISHED_LENGTH  # max_model_len reached
    assert request.token_ids == [10, 11, 12, 13, 4]


def test_request_does_not_stop_on_eos_or_stop_token_ids_before_min_tokens():
    request = _running(SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[5]))
    for token in (2, 5):  # what a worker that does not mask them could send
        request.append_output(token)
        assert request.check_stop(100) is None
    request.append_output(5)  # the third output token: min_tokens reached
    assert request.check_stop(100) is S.FINISHED_STOPPED


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt_token_ids=[]), "no tokens"),
        (dict(prompt_token_ids=[1], weight=0.0), "weight"),
        (dict(prompt_token_ids=[-1]), ">= 0"),
    ],
)
def test_request_rejects_bad_fields(kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        Request("r", **kwargs)
