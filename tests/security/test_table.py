"""Rows 5, 6 and 7 of issue 13's table, each tried against a real router and scheduler.

5. A Submit straight to the scheduler with a prompt token past the model's embedding rows
   broke the pipeline over and over: refused with INVALID_ARGUMENT before any worker sees it.
6. Hostile field values got UNKNOWN or INTERNAL, stalled the router, or were accepted and
   sampled token 0 forever: every one is INVALID_ARGUMENT naming the field and the limit.
7. Millions of stop token ids stalled others and bloated Redis for the finished TTL: refused
   by the router and by the scheduler, with nothing written to Redis.
"""

from __future__ import annotations

import json
import math
import threading

import grpc
import pytest
import redis

from services.common.proto.conveyor.v1 import common_pb2, generation_pb2, scheduler_pb2
from services.common.proto.inference import grpc_service_pb2 as kserve_pb2
from services.router.kserve_tensors import encode_bytes
from services.router.tokenizer import Tokenizer
from tests.security.utils import rpc_error

VOCAB_SIZE = 512  # the tiny model's embedding rows (config.json vocab_size)


def _submit(request_id: str, prompt: list[int], **sampling) -> scheduler_pb2.SubmitRequest:
    sampling.setdefault("max_tokens", 4)
    return scheduler_pb2.SubmitRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(**sampling),
    )


def _generate(stack, timeout: float = 60, **fields) -> list[int]:
    """Every output token id of a Generate call."""
    sampling = fields.pop("sampling", {})
    request = generation_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(**sampling), **fields
    )
    return [i for msg in stack.generation.Generate(request, timeout=timeout) for i in msg.token_ids]


def _kserve(model_name: str, text: str, params: str) -> kserve_pb2.ModelInferRequest:
    msg = kserve_pb2.ModelInferRequest(model_name=model_name)
    for name, value in (("text_input", text), ("sampling_parameters", params)):
        msg.inputs.add(name=name, datatype="BYTES", shape=[1])
        msg.raw_input_contents.append(encode_bytes([value.encode()]))
    return msg


# -- row 5 -------------------------------------------------------------------------------
def test_row5_scheduler_refuses_prompt_token_past_the_embedding(stack):
    bad = _submit("row5-direct", [1, 2, VOCAB_SIZE + 88])
    error = rpc_error(stack.scheduler_stub.Submit, bad, timeout=30)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
    assert "prompt_token_ids[2]=600 is out of range" in error.details()
    assert f"vocab_size is {VOCAB_SIZE}" in error.details()
    # the pipeline never saw it: the next request is served, and everything is SERVING
    deltas = list(stack.scheduler_stub.Submit(_submit("row5-after", [1, 2, 3]), timeout=60))
    assert sum(len(d.token_ids) for d in deltas) == 4
    assert deltas[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert stack.is_serving()


def test_router_checks_token_ids_against_the_embedding_rows(stack, security_model_dir):
    tokenizer_vocab = Tokenizer.from_dir(security_model_dir).vocab_size
    assert tokenizer_vocab < VOCAB_SIZE  # the tiny model has more rows than its tokenizer
    ids = _generate(
        stack,
        token_ids=generation_pb2.TokenIds(ids=[tokenizer_vocab + 10, 5]),
        sampling={"max_tokens": 2},
    )
    assert len(ids) == 2
    error = rpc_error(
        _generate, stack, token_ids=generation_pb2.TokenIds(ids=[5, VOCAB_SIZE]), timeout=30
    )
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"token_ids[1]={VOCAB_SIZE} is out of range" in error.details()


# -- row 6 -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"text": "x" * 4_000_000}, "at most 1048576 bytes (--max-prompt-bytes)"),
        ({"text": "hi", "sampling": {"repetition_penalty": math.nan}}, "repetition_penalty=nan"),
        ({"text": "hi", "sampling": {"top_p": math.inf}}, "top_p=inf is not a finite number"),
        ({"text": "hi", "sampling": {"min_p": 5e-324}}, "min_p=5e-324 is subnormal"),
        ({"text": "hi", "request_id": "x\n"}, "request_id='x\\n' is not allowed"),
        ({"text": "hi", "tenant": "t" * (1 << 20)}, "at most 128 (--max-tenant-chars)"),
        ({"text": "hi", "priority": -(2**31)}, "must be in [-1000, 1000] (--max-abs-priority)"),
        ({"text": "hi", "model": "m" * 100_000}, "is not served here"),
        ({"text": "hi", "sampling": {"logprobs": 21}}, "[0, 20] (--max-logprobs)"),
        (
            {"text": "hi", "sampling": {"stop_token_ids": [3, VOCAB_SIZE]}},
            f"stop_token_ids[1]={VOCAB_SIZE} is out of range",
        ),
    ],
    ids=[
        "4mb-text",
        "nan",
        "inf",
        "subnormal",
        "request-id",
        "tenant",
        "priority",
        "model",
        "logprobs",
        "stop-id",
    ],
)
def test_row6_router_refuses_hostile_fields_naming_them(stack, fields, expected):
    error = rpc_error(_generate, stack, timeout=60, **fields)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
    assert expected in error.details()
    assert len(error.details()) < 1000  # the value is quoted clipped, never whole


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"seed": -1}, "seed=-1 is out of range"),
        ({"top_k": 2**40}, f"top_k={2**40} is out of range"),
        ({"stop_token_ids": [2**33]}, f"stop_token_ids[0]={2**33} is out of range"),
        ({"temperature": 1e999}, "temperature=inf is not a finite number"),
        ({"max_tokens": 1e999}, "sampling_parameters.max_tokens=inf has the wrong type"),
        ({"stop_token_ids": {"a": 1}}, "sampling_parameters.stop_token_ids={'a': 1}"),
    ],
    ids=["seed", "top-k", "stop-id", "temperature", "max-tokens", "stop-ids-type"],
)
def test_row6_kserve_refuses_out_of_range_parameters(stack, params, expected):
    request = _kserve(stack.model_name, "hi", json.dumps(params))
    error = rpc_error(stack.kserve.ModelInfer, request, timeout=30)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
    assert expected in error.details()


@pytest.mark.parametrize(
    "params, expected",
    [
        ("[" * 100_000 + "]" * 100_000, "at most 65536 (--max-json-bytes)"),
        ('{"stop": ' + "[" * 1000 + "]" * 1000 + "}", "at most 16 (--max-json-depth)"),
        ('{"seed": ' + "1" * 5000 + "}", "not valid JSON"),
    ],
    ids=["100k-deep", "1k-deep", "5000-digit-int"],
)
def test_row6_kserve_bounds_the_json_before_parsing_it(stack, params, expected):
    error = rpc_error(stack.kserve.ModelInfer, _kserve(stack.model_name, "hi", params), timeout=30)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
    assert expected in error.details()


GENERATE = "/conveyor.v1.Generation/Generate"
SUBMIT = "/conveyor.v1.Scheduler/Submit"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


@pytest.mark.parametrize(
    "target, method, raw",
    [
        ("router", GENERATE, b"\x0a\x03h\xff\xfe"),  # text = invalid UTF-8
        ("router", GENERATE, b"\xff\xff\xff\xff\xff"),  # not protobuf at all
        ("router", STREAM_INFER, b"\x0a\x02\xc3\x28"),  # model_name = invalid UTF-8
        ("scheduler", SUBMIT, b"\x0a\x02\xc3\x28"),  # request_id = invalid UTF-8
        ("scheduler", SUBMIT, b"\x12\x05\xff\xff\xff\xff\xff"),  # a truncated varint
    ],
    ids=["generate-utf8", "generate-garbage", "stream-infer-utf8", "submit-utf8", "submit-cut"],
)
def test_row6_undecodable_bytes_are_invalid_argument(stack, target, method, raw):
    channel = stack.router_channel if target == "router" else stack.scheduler_channel
    if method == STREAM_INFER:
        call = channel.stream_stream(method)(iter([raw]), timeout=30)
    else:
        call = channel.unary_stream(method)(raw, timeout=30)
    error = rpc_error(list, call)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
    assert "is not a valid" in error.details()


def test_row6_tiny_temperature_is_greedy(stack):
    prompt = {"token_ids": generation_pb2.TokenIds(ids=[5, 6, 7])}
    common = {"max_tokens": 8, "ignore_eos": True}
    greedy = _generate(stack, sampling=common, **prompt)
    tiny = _generate(stack, sampling={**common, "temperature": 1e-300, "seed": 3}, **prompt)
    assert tiny == greedy and len(greedy) == 8


@pytest.mark.parametrize(
    "sampling, extra, expected",
    [
        ({"repetition_penalty": math.nan}, {}, "repetition_penalty=nan is not a finite number"),
        ({"stop_token_ids": [VOCAB_SIZE]}, {}, f"stop_token_ids[0]={VOCAB_SIZE}"),
        ({"logprobs": 1000}, {}, "logprobs=1000 is out of range"),
        ({}, {"request_id": "x\n"}, "request_id='x\\n' is not allowed"),
        ({}, {"tenant": "t" * (1 << 20)}, "(--max-tenant-chars)"),
        ({}, {"priority": -(2**31)}, "(--max-abs-priority)"),
        ({}, {"weight": math.inf}, "weight=inf is out of range"),
        ({}, {"prompt_token_ids": []}, "prompt_token_ids is empty"),
    ],
    ids=["nan", "stop-id", "logprobs", "request-id", "tenant", "priority", "weight", "empty"],
)
def test_row6_scheduler_refuses_hostile_fields_itself(stack, sampling, extra, expected):
    request = _submit("row6-scheduler", [1, 2, 3], **sampling)
    for name, value in extra.items():
        if name == "prompt_token_ids":
            request.ClearField(name)
        else:
            setattr(request, name, value)
    error = rpc_error(stack.scheduler_stub.Submit, request, timeout=30)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
    assert expected in error.details()


# -- row 7 -------------------------------------------------------------------------------
def test_row7_millions_of_stop_token_ids_are_refused_and_never_stored(stack):
    stop_ids = [1] * 3_900_000  # one byte each: the message stays under 4 MiB
    other: list[int] = []
    reader = threading.Thread(
        target=lambda: other.extend(
            _generate(
                stack,
                token_ids=generation_pb2.TokenIds(ids=[9, 8, 7]),
                sampling={"max_tokens": 64, "ignore_eos": True},
            )
        )
    )
    reader.start()
    for attempt in range(4):
        request_id = f"row7-{attempt}"
        error = rpc_error(
            stack.scheduler_stub.Submit, _submit(request_id, [1, 2, 3], stop_token_ids=stop_ids)
        )
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
        assert "stop_token_ids has 3900000 ids, too many: at most 128" in error.details()
        error = rpc_error(
            _generate,
            stack,
            text="hi",
            request_id=f"{request_id}-router",
            sampling={"stop_token_ids": stop_ids},
        )
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
        assert "(--max-stop-token-ids)" in error.details()
    reader.join(timeout=120)
    assert len(other) == 64  # the other client was served whole meanwhile
    keys = redis.Redis.from_url(stack.redis_url).keys("{req:row7-*")
    assert keys == []  # nothing of the refused requests reached Redis
