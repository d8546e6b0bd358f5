"""Capacity limits: a huge prompt is tokenized off the event loop, RPCs per router, requests
per KServe stream, and message sizes at the router and the scheduler.

The tight router runs over the fake scheduler, which streams tokens at a pace the test sets;
`--max-concurrent-rpcs 3 --max-stream-requests 2 --max-prompt-bytes 4MiB`.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc

from services.common.proto.conveyor.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    scheduler_pb2,
)
from services.common.proto.inference import grpc_service_pb2 as kserve_pb2
from services.common.proto.inference import grpc_service_pb2_grpc as kserve_pb2_grpc
from services.router.kserve_tensors import encode_bytes
from tests.router.utils import wait_until
from tests.security.utils import rpc_error, unary_outcome


class StreamReader:
    """Reads an endless Generate stream in a thread, noting when each message arrived."""

    def __init__(self, stub: generation_pb2_grpc.GenerationStub):
        request = generation_pb2.GenerateRequest(
            text="hi", sampling=common_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
        )
        self.call = stub.Generate(request, timeout=300)
        self.arrivals: list[float] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for _ in self.call:
                self.arrivals.append(time.monotonic())
        except grpc.RpcError:
            pass  # cancelled by stop()

    def wait_for(self, num_messages: int) -> None:
        wait_until(lambda: len(self.arrivals) >= num_messages, what="stream messages")

    def stop(self) -> None:
        self.call.cancel()
        self.thread.join(timeout=30)


def test_a_4mb_prompt_does_not_stall_another_stream(fake, tight_router):
    fake.reset(mode="endless", delay_s=0.005)  # a token every 5 ms, until cancelled
    with grpc.insecure_channel(tight_router.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        other = StreamReader(stub)
        other.wait_for(5)
        text = ("The quick brown fox jumps over the lazy dog. " * 100_000)[:4_000_000]
        sent = time.monotonic()
        error = rpc_error(
            list, stub.Generate(generation_pb2.GenerateRequest(text=text), timeout=300)
        )
        answered = time.monotonic()
        other.stop()
    # tokenized whole (it fits --max-prompt-bytes), then refused for the model's context
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
    assert "too long: the model's context length is 256" in error.details()
    # the other stream kept receiving while the big prompt was tokenized: tokens arrived in
    # the middle half of that time, not only before it or in a burst after it
    quarter = (answered - sent) / 4
    during = [t for t in other.arrivals if sent + quarter <= t <= answered - quarter]
    assert during, (
        f"no token of the other stream arrived between {quarter:.3f} s and "
        f"{3 * quarter:.3f} s after the big prompt was sent"
    )


def test_router_refuses_rpcs_past_max_concurrent_rpcs(fake, tight_router):
    fake.reset(mode="endless", delay_s=0.01)
    with grpc.insecure_channel(tight_router.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        streams = [StreamReader(stub) for _ in range(3)]
        for stream in streams:
            stream.wait_for(1)
        tokenize = generation_pb2.TokenizeRequest(text="hello")
        code = unary_outcome(stub.Tokenize, tokenize, timeout=30)
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        for stream in streams:
            stream.stop()
        # capacity comes back once the streams are gone
        wait_until(
            lambda: unary_outcome(stub.Tokenize, tokenize, timeout=30) is grpc.StatusCode.OK,
            what="the router to take RPCs again",
        )


def _stream_request(model_name: str, request_id: str) -> kserve_pb2.ModelInferRequest:
    msg = kserve_pb2.ModelInferRequest(model_name=model_name, id=request_id)
    for name, datatype, raw in (
        ("text_input", "BYTES", encode_bytes([b"hi"])),
        ("stream", "BOOL", b"\x01"),
        ("sampling_parameters", "BYTES", encode_bytes([b'{"max_tokens": 200}'])),
    ):
        msg.inputs.add(name=name, datatype=datatype, shape=[1])
        msg.raw_input_contents.append(raw)
    return msg


def test_kserve_stream_runs_at_most_max_stream_requests(fake, tight_router, security_model_dir):
    fake.reset(mode="endless", delay_s=0.01)
    requests: queue.Queue = queue.Queue()
    responses: list[kserve_pb2.ModelStreamInferResponse] = []
    with grpc.insecure_channel(tight_router.address) as channel:
        stub = kserve_pb2_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelStreamInfer(iter(requests.get, None), timeout=300)
        reader = threading.Thread(target=lambda: _collect(call, responses), daemon=True)
        reader.start()

        def seen(request_id: str) -> list[kserve_pb2.ModelStreamInferResponse]:
            return [r for r in list(responses) if r.infer_response.id == request_id]

        for request_id in ("a", "b"):
            requests.put(_stream_request(security_model_dir.name, request_id))
            wait_until(lambda rid=request_id: seen(rid), what=f"responses to {request_id}")
        requests.put(_stream_request(security_model_dir.name, "c"))
        wait_until(lambda: seen("c"), what="the answer to the third request")
        (refusal,) = seen("c")
        assert "already runs 2 requests" in refusal.error_message
        assert "--max-stream-requests" in refusal.error_message
        # the stream goes on: the first two keep streaming after the refusal
        num_a, num_b = len(seen("a")), len(seen("b"))
        wait_until(lambda: len(seen("a")) > num_a and len(seen("b")) > num_b, what="more tokens")
        assert all(not r.error_message for r in seen("a") + seen("b"))
        call.cancel()
        reader.join(timeout=30)


def _collect(call, responses: list) -> None:
    try:
        for response in call:
            responses.append(response)
    except grpc.RpcError:
        pass  # cancelled


def test_messages_past_the_size_limit_are_resource_exhausted(tight_router, stack):
    big = "x" * (5 << 20)  # over the 4 MiB default of --max-message-bytes
    with grpc.insecure_channel(tight_router.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        error = rpc_error(list, stub.Generate(generation_pb2.GenerateRequest(text=big)))
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    request = scheduler_pb2.SubmitRequest(request_id="too-big", tenant=big)
    error = rpc_error(list, stack.scheduler_stub.Submit(request, timeout=30))
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
