"""Hostile requests, generated: every field of GenerateRequest, ModelInferRequest and
SubmitRequest, and raw bytes to every method, against the real router and scheduler.

Each answer must be a result or a refusal (REFUSALS): never INTERNAL or UNKNOWN (a bug),
UNAVAILABLE (a broken service) or DEADLINE_EXCEEDED (a stalled one); both services are
SERVING afterwards and still generate. Streams are cancelled after their first message, so
a request that is valid costs one step. Derandomized: the same examples on every run.
"""

from __future__ import annotations

import json
import math

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.proto.conveyor.v1 import common_pb2, generation_pb2, scheduler_pb2
from services.common.proto.inference import grpc_service_pb2 as kserve_pb2
from services.router.kserve_tensors import INPUT_NAMES, SAMPLING_KEYS, encode_bytes
from services.router.request import CHAT_ROLES
from tests.security.utils import REFUSALS, first_outcome, unary_outcome

FUZZ = settings(
    max_examples=500,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
TIMEOUT_S = 60
ANSWERS = REFUSALS | {grpc.StatusCode.OK}

FLOATS = st.one_of(
    st.floats(),
    st.sampled_from([0.0, 1e-300, 5e-324, 1e-6, 0.5, 1.0, 2.0, 1e308, math.nan, -math.inf]),
)
UINT32 = st.one_of(st.integers(0, 600), st.integers(0, 2**32 - 1))
INT32 = st.integers(-(2**31), 2**31 - 1)
TEXT = st.text(max_size=24)


@st.composite
def sampling_params(draw) -> common_pb2.SamplingParams:
    fields = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "temperature": FLOATS,
                "top_p": FLOATS,
                "top_k": INT32,
                "min_p": FLOATS,
                "repetition_penalty": FLOATS,
                "presence_penalty": FLOATS,
                "frequency_penalty": FLOATS,
                "seed": st.integers(0, 2**64 - 1),
                "max_tokens": st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)),
                "stop_token_ids": st.lists(UINT32, max_size=6) | st.lists(UINT32, min_size=129),
                "ignore_eos": st.booleans(),
                "logprobs": st.integers(0, 25) | UINT32,
            },
        )
    )
    return common_pb2.SamplingParams(**fields)


PLAIN_SAMPLING = st.builds(  # valid: so that fuzzed requests also run, not only fail early
    common_pb2.SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1e-300]),
    max_tokens=st.integers(1, 8),
    seed=st.integers(0, 2**64 - 1),
    stop_token_ids=st.lists(st.integers(0, 511), max_size=3),
    logprobs=st.integers(0, 20),
)
PROMPTS = st.one_of(
    st.fixed_dictionaries({"text": TEXT}),
    st.fixed_dictionaries(
        {"token_ids": st.builds(generation_pb2.TokenIds, ids=st.lists(UINT32, max_size=8))}
    ),
    st.fixed_dictionaries(
        {
            "chat": st.builds(
                generation_pb2.Chat,
                messages=st.lists(
                    st.builds(
                        generation_pb2.ChatMessage,
                        role=st.sampled_from([*CHAT_ROLES, "robot", ""]),
                        content=TEXT,
                    ),
                    max_size=3,
                ),
            )
        }
    ),
    st.just({}),
)
REQUEST_IDS = st.one_of(st.text(max_size=12), st.from_regex(r"\A[A-Za-z0-9._:-]{1,24}\Z"))


@st.composite
def generate_requests(draw, model_name: str) -> generation_pb2.GenerateRequest:
    fields = draw(PROMPTS)
    fields |= draw(
        st.fixed_dictionaries(
            {},
            optional={
                "sampling": sampling_params() | PLAIN_SAMPLING,
                "stop": st.lists(st.text(max_size=300), max_size=20),
                "include_stop_str_in_output": st.booleans(),
                "priority": INT32,
                "tenant": st.text(max_size=200),
                "request_id": REQUEST_IDS,
                "model": st.sampled_from(["", model_name]) | TEXT,
            },
        )
    )
    return generation_pb2.GenerateRequest(**fields)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | FLOATS | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(TEXT, children, max_size=4),
    max_leaves=12,
)
HOSTILE_JSON = st.one_of(  # one key, with a value past what its type or wire field holds
    st.tuples(
        st.sampled_from(["seed", "top_k", "max_tokens", "logprobs", "n"]),
        st.sampled_from([-1, 2**40, 2**64, -(2**63), 1e999, "1" * 5000, "x"]),
    ),
    st.tuples(st.just("stop_token_ids"), st.sampled_from([[2**33], [-1], [1e999], "5", {}])),
    st.tuples(
        st.sampled_from(["temperature", "top_p", "min_p", "repetition_penalty"]),
        st.sampled_from([math.nan, 1e999, 5e-324, 1e-300, "nan", 10**400, [1]]),
    ),
    st.tuples(st.just("stop"), st.sampled_from([[1], {"a": 1}, "x" * 300, [None]])),
).map(lambda item: {item[0]: item[1]})
SAMPLING_JSON = st.one_of(
    HOSTILE_JSON,
    HOSTILE_JSON,
    st.dictionaries(
        st.sampled_from(SAMPLING_KEYS) | st.text(max_size=8),
        st.integers(-2, 8) | JSON_VALUES,
        max_size=5,
    ),
).map(json.dumps) | st.text(max_size=40)  # the text: mostly not JSON


def _bytes_tensor(values) -> st.SearchStrategy:
    return values.map(lambda v: ("BYTES", encode_bytes([v.encode("utf-8", "surrogatepass")])))


RAW_TENSORS = st.tuples(
    st.sampled_from(["BYTES", "BOOL", "INT32", "INT64", "UINT8", "FP32", "FP64"]) | TEXT,
    st.binary(max_size=16),
)


def _rarely(draw) -> bool:
    """True one time in four: the request stays well-formed often enough to run."""
    return draw(st.booleans()) and draw(st.booleans())  # integers() favour their bounds


@st.composite
def model_infer_requests(draw, model_name: str) -> kserve_pb2.ModelInferRequest:
    tensors = draw(
        st.fixed_dictionaries(
            {"text_input": RAW_TENSORS if _rarely(draw) else _bytes_tensor(TEXT)},
            optional={
                "sampling_parameters": RAW_TENSORS
                if _rarely(draw)
                else _bytes_tensor(SAMPLING_JSON),
                "stream": st.tuples(st.just("BOOL"), st.sampled_from([b"\x00", b"\x01"])),
                "exclude_input_in_output": st.tuples(
                    st.just("BOOL"), st.binary(max_size=2) if _rarely(draw) else st.just(b"\x01")
                ),
            },
        )
    )
    if _rarely(draw):  # inputs the convention does not have, or sampling keys as tensors
        names = st.sampled_from([*INPUT_NAMES, *SAMPLING_KEYS]) | TEXT
        tensors = draw(st.dictionaries(names, RAW_TENSORS, max_size=2)) | tensors
    msg = kserve_pb2.ModelInferRequest(
        model_name=draw(TEXT) if _rarely(draw) else model_name,
        model_version=draw(st.sampled_from(["", "1"]) | TEXT),
        id=draw(TEXT),
    )
    if draw(st.booleans()):
        msg.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, (datatype, raw) in tensors.items():
        shape = [1] if not _rarely(draw) else draw(st.lists(st.integers(-2, 4), max_size=2))
        msg.inputs.add(name=name, datatype=datatype, shape=shape)
        msg.raw_input_contents.append(raw)
    if _rarely(draw):  # typed contents instead of raw bytes: whatever bytes they hold
        for tensor in msg.inputs:
            tensor.contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=8), max_size=2)))
        del msg.raw_input_contents[:]
    return msg


SUBMIT_REQUESTS = st.builds(  # valid often enough that accepted requests run too
    scheduler_pb2.SubmitRequest,
    request_id=REQUEST_IDS,
    prompt_token_ids=st.lists(st.integers(0, 600), min_size=1, max_size=8)
    | st.lists(UINT32, max_size=8),
    sampling=sampling_params() | PLAIN_SAMPLING,
    priority=st.integers(-3, 3) | INT32,
    tenant=st.text(max_size=200),
    weight=st.just(0.0) | FLOATS,
)


def _answer(code: grpc.StatusCode, what) -> None:
    assert code in ANSWERS, f"{code.name} for {what!r}"


def _still_serves(stack) -> None:
    assert stack.is_serving()
    request = generation_pb2.GenerateRequest(
        text="still there?", sampling=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True)
    )
    ids = [i for m in stack.generation.Generate(request, timeout=TIMEOUT_S) for i in m.token_ids]
    assert len(ids) == 3


def test_fuzz_generate_requests(stack):
    @FUZZ
    @given(generate_requests(stack.model_name))
    def run(request):
        _answer(first_outcome(stack.generation.Generate(request, timeout=TIMEOUT_S)), request)

    run()
    _still_serves(stack)


def test_fuzz_model_infer_requests(stack):
    @FUZZ
    @given(model_infer_requests(stack.model_name), st.booleans())
    def run(request, is_unary):
        if is_unary:
            code = unary_outcome(stack.kserve.ModelInfer, request, timeout=TIMEOUT_S)
        else:  # a failed request answers in the stream: its message must not be a bug's
            call = stack.kserve.ModelStreamInfer(iter([request]), timeout=TIMEOUT_S)
            try:
                first = next(iter(call), None)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                first, code = None, exc.code()
            finally:
                call.cancel()
            if code is grpc.StatusCode.OK:
                assert first is not None, f"no answer to {request!r}"
                assert "internal error" not in first.error_message, (first.error_message, request)
        _answer(code, request)

    run()
    _still_serves(stack)


def test_fuzz_submit_requests_to_the_scheduler(stack):
    @FUZZ
    @given(SUBMIT_REQUESTS)
    def run(request):
        code = first_outcome(stack.scheduler_stub.Submit(request, timeout=TIMEOUT_S))
        _answer(code, request)
        if code is grpc.StatusCode.OK:  # free what was accepted
            abort = scheduler_pb2.AbortRequest(request_id=request.request_id)
            _answer(unary_outcome(stack.scheduler_stub.Abort, abort, timeout=TIMEOUT_S), abort)

    run()
    _still_serves(stack)


# (service, method, kind) of every method a client can reach
METHODS = [
    ("router", "/conveyor.v1.Generation/Generate", "unary_stream"),
    ("router", "/conveyor.v1.Generation/Resume", "unary_stream"),
    ("router", "/conveyor.v1.Generation/Tokenize", "unary_unary"),
    ("router", "/conveyor.v1.Generation/ListModels", "unary_unary"),
    ("router", "/inference.GRPCInferenceService/ModelInfer", "unary_unary"),
    ("router", "/inference.GRPCInferenceService/ModelStreamInfer", "stream_stream"),
    ("router", "/inference.GRPCInferenceService/ModelMetadata", "unary_unary"),
    ("router", "/inference.GRPCInferenceService/ModelReady", "unary_unary"),
    ("router", "/grpc.health.v1.Health/Check", "unary_unary"),
    ("scheduler", "/conveyor.v1.Scheduler/Submit", "unary_stream"),
    ("scheduler", "/conveyor.v1.Scheduler/Abort", "unary_unary"),
    ("scheduler", "/conveyor.v1.Scheduler/Resume", "unary_stream"),
    ("scheduler", "/conveyor.v1.Scheduler/GetStats", "unary_unary"),
    ("scheduler", "/conveyor.v1.Scheduler/Session", "stream_stream"),
]
VALID = [
    generation_pb2.GenerateRequest(text="hi").SerializeToString(),
    generation_pb2.ResumeGenerationRequest(request_id="x", offset=3).SerializeToString(),
    scheduler_pb2.SubmitRequest(request_id="x", prompt_token_ids=[1, 2]).SerializeToString(),
    scheduler_pb2.ResumeRequest(request_id="x", from_offset=3).SerializeToString(),
    scheduler_pb2.SessionRequest(
        stream_id=1, submit=scheduler_pb2.SubmitRequest(request_id="x", prompt_token_ids=[1, 2])
    ).SerializeToString(),
]


@st.composite
def raw_messages(draw) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=64))
    base = draw(st.sampled_from(VALID))  # a valid message with some bytes overwritten
    pos = draw(st.integers(0, len(base)))
    junk = draw(st.binary(min_size=1, max_size=6))
    return base[:pos] + junk + base[pos + len(junk) :]


def test_fuzz_raw_bytes_to_every_method(stack):
    channels = {"router": stack.router_channel, "scheduler": stack.scheduler_channel}

    @FUZZ
    @given(st.sampled_from(METHODS), raw_messages())
    def run(target, raw):
        service, method, kind = target
        callable_ = getattr(channels[service], kind)(method)
        if kind == "unary_unary":
            code = unary_outcome(callable_, raw, timeout=TIMEOUT_S)
        elif kind == "unary_stream":
            code = first_outcome(callable_(raw, timeout=TIMEOUT_S))
        else:
            code = first_outcome(callable_(iter([raw]), timeout=TIMEOUT_S))
        _answer(code, (method, raw))

    run()
    _still_serves(stack)
