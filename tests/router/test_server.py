"""`conveyor router` against a fake scheduler: streaming, stops, aborts, errors, resume."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client import ConveyorClient
from tests.router.utils import ANSWER, RouterProcess, wait_until


@pytest.fixture()
def client(router):
    with ConveyorClient(router.address, timeout_s=30) as c:
        yield c


def test_router_streams_text_and_usage(fake, client, tiny_tokenizer):
    deltas = list(client.generate("Say hi", max_tokens=200))
    assert "".join(d.text for d in deltas) == ANSWER
    assert len(deltas) > 5  # streamed, not one message
    assert all("\ufffd" not in d.text for d in deltas)
    ids = [i for d in deltas for i in d.token_ids]
    assert ids == fake.answer_ids
    assert [d.offset for d in deltas] == [
        sum(len(x.token_ids) for x in deltas[:k]) for k in range(len(deltas))
    ]
    last = deltas[-1]
    assert last.finish_reason == "stop"
    prompt_ids = tiny_tokenizer.encode("Say hi")
    assert last.usage == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(ids),
        "cached_tokens": 0,
    }
    assert list(fake.submits[-1].prompt_token_ids) == prompt_ids


def test_router_passes_sampling_and_chat_to_scheduler(fake, client, tiny_tokenizer):
    result = client.complete(
        chat=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0.7,
        top_k=5,
        seed=3,
        min_tokens=2,
        priority=2,
        tenant="t1",
    )
    assert result.finish_reason == "length" and len(result.token_ids) == 4
    sent = fake.submits[-1]
    rendered = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert list(sent.prompt_token_ids) == tiny_tokenizer.encode(rendered, add_special_tokens=False)
    sampling = sent.sampling
    assert (sampling.max_tokens, sampling.top_k, sampling.seed, sampling.min_tokens) == (4, 5, 3, 2)
    assert abs(sent.sampling.temperature - 0.7) < 1e-9
    assert (sent.priority, sent.tenant) == (2, "t1")


def test_router_stop_string_across_deltas_aborts_request(fake, client):
    fake.reset(ids_per_delta=2)
    result = client.complete("x", max_tokens=200, stop=["brown fox"], request_id="stop-1")
    assert result.text == ANSWER[: ANSWER.index("brown fox")]
    assert result.finish_reason == "stop"
    wait_until(lambda: "stop-1" in fake.aborts, what="abort after the stop string")


def test_router_client_cancel_aborts_request(fake, client):
    fake.reset(mode="endless", delay_s=0.01)
    stream = client.generate("x", max_tokens=200, ignore_eos=True, request_id="cancel-1")
    for index, _ in enumerate(stream):
        if index == 3:
            break
    stream.close()  # cancels the RPC
    wait_until(lambda: "cancel-1" in fake.aborts, what="abort after the client cancelled")


def test_router_deadline_aborts_request(fake, router):
    fake.reset(mode="endless", delay_s=0.01)
    with (
        ConveyorClient(router.address, timeout_s=0.5) as short,
        pytest.raises(grpc.RpcError) as info,
    ):
        short.complete("x", max_tokens=200, request_id="deadline-1")
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: "deadline-1" in fake.aborts, what="abort after the deadline")


@pytest.mark.parametrize(
    "code, hint",
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "retry with backoff"),
        (grpc.StatusCode.UNAVAILABLE, "retry when `conveyor health` reports SERVING"),
        (grpc.StatusCode.ALREADY_EXISTS, "request ids must be unique"),
    ],
)
def test_router_passes_scheduler_errors_through(fake, client, code, hint):
    fake.reset(mode=code, error_message="queue has 8 waiting requests (max 8)")
    with pytest.raises(grpc.RpcError) as info:
        client.complete("x", max_tokens=4)
    assert info.value.code() is code
    assert "queue has 8 waiting requests (max 8)" in info.value.details()
    assert hint in info.value.details()


def test_router_resumes_a_broken_stream_without_gap_or_duplicate(fake, client):
    fake.reset(mode="break", break_after=5, ids_per_delta=2)
    result = client.complete("x", max_tokens=200, request_id="resume-1")
    assert result.text == ANSWER
    assert result.token_ids == fake.answer_ids
    assert fake.resumes and fake.resumes[0][0] == "resume-1"


def test_router_submits_again_a_request_no_scheduler_took(fake, client):
    """The session breaks as the Submit arrives (a scheduler that dies or stops before
    reading it): nothing was persisted, the resume finds nothing, and the router submits it
    again instead of failing it (a Submit the scheduler refuses stays refused: above)."""
    fake.reset(mode="lose-submit")
    result = client.complete("x", max_tokens=5, request_id="lost-1")
    assert result.token_ids == fake.answer_ids[:5]
    assert [s.request_id for s in fake.submits] == ["lost-1"]  # the second reached Submit
    assert fake.resumes == [("lost-1", 0)]


def test_router_rejects_invalid_fields_and_keeps_serving(fake, client):
    with pytest.raises(grpc.RpcError) as info:
        client.complete("x", top_p=1.5)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p=1.5" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        client.complete("x", max_tokens=1000)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens (1000)" in info.value.details() and "256" in info.value.details()
    assert not fake.submits  # nothing reached the scheduler
    assert client.complete("x", max_tokens=3).finish_reason == "length"


def test_router_tokenize_and_list_models(client, tiny_tokenizer, tiny_model_dir):
    assert client.tokenize("Hello world") == tiny_tokenizer.encode("Hello world")
    assert client.list_models() == [{"name": tiny_model_dir.name, "max_model_len": 256}]


def test_router_health_follows_scheduler(scheduler_server, router, fake):
    def status():
        with grpc.insecure_channel(router.address) as channel:
            return (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(), timeout=5)
                .status
            )

    scheduler_server.set_serving(False)
    wait_until(
        lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, what="router NOT_SERVING"
    )
    scheduler_server.set_serving(True)
    # A request right away is served: the router looks again rather than refuse on a view
    # up to a poll interval old (seen as UNAVAILABLE after a worker restart).
    with ConveyorClient(router.address, timeout_s=30) as client:
        assert client.complete("x", max_tokens=200).text == ANSWER
    wait_until(lambda: status() == health_pb2.HealthCheckResponse.SERVING, what="router SERVING")


def test_two_routers_share_one_scheduler(fake, scheduler_server, router, tiny_model_dir):
    second = RouterProcess(
        scheduler_server.address, tiny_model_dir, "--served-model-name", "other-name"
    ).wait_serving()
    try:
        with (
            ConveyorClient(second.address, timeout_s=30) as other,
            ConveyorClient(router.address, timeout_s=30) as first,
        ):
            a = first.complete("x", max_tokens=200, request_id="two-a")
            b = other.complete("x", max_tokens=200, request_id="two-b", model="other-name")
            assert a.text == b.text == ANSWER
            assert other.list_models()[0]["name"] == "other-name"
    finally:
        assert second.stop() == 0  # graceful stop on SIGTERM
    assert [s.request_id for s in fake.submits] == ["two-a", "two-b"]
