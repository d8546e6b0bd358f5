"""Every invalid field is refused with a message naming the field, the value and the range."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidRequest, PromptTooLong
from services.common.proto.conveyor.v1 import common_pb2, generation_pb2
from services.common.proto.inference import grpc_service_pb2 as kserve_pb2
from services.router.generation import input_from_pb
from services.router.kserve_tensors import encode_bytes, request_from_pb
from services.router.request import ModelLimits, prepare

LIMITS = ModelLimits(name="tiny-chat", max_model_len=64, vocab_size=512, max_stop_strings=4)


def _prepare(tokenizer, **fields):
    sampling = fields.pop("sampling", {})
    msg = generation_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling), **fields)
    return prepare(input_from_pb(msg), tokenizer, LIMITS)


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({}, "prompt is missing"),
        ({"text": ""}, "text is empty"),
        ({"text": "hi", "sampling": {"temperature": -0.5}}, "temperature=-0.5 is out of range"),
        (
            {"text": "hi", "sampling": {"top_p": 1.5}},
            "top_p=1.5 is out of range: must be in (0, 1]",
        ),
        ({"text": "hi", "sampling": {"top_p": -0.1}}, "top_p=-0.1"),
        ({"text": "hi", "sampling": {"top_k": -3}}, "top_k=-3 is out of range"),
        ({"text": "hi", "sampling": {"min_p": 2.0}}, "min_p=2.0 is out of range"),
        ({"text": "hi", "sampling": {"presence_penalty": 3.0}}, "presence_penalty=3.0"),
        ({"text": "hi", "sampling": {"logprobs": 50}}, "logprobs=50 is out of range"),
        ({"text": "hi", "model": "gpt-4"}, "model='gpt-4' is not served here"),
        (
            {"text": "hi", "stop": ["a", "b", "c", "d", "e"]},
            "stop has 5 strings, too many: at most 4",
        ),
        ({"text": "hi", "stop": ["ok", ""]}, "stop[1] is empty"),
        ({"text": "hi", "request_id": "bad id!"}, "request_id='bad id!' is not allowed"),
        ({"token_ids": generation_pb2.TokenIds(ids=[])}, "token_ids is empty"),
        (
            {"token_ids": generation_pb2.TokenIds(ids=[1, 99999])},
            "token_ids[1]=99999 is out of range",
        ),
        ({"chat": generation_pb2.Chat()}, "chat.messages is empty"),
        (
            {"chat": generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="robot")])},
            "chat.messages[0].role='robot' is not allowed",
        ),
    ],
)
def test_prepare_rejects_field_with_its_name(tiny_tokenizer, fields, expected):
    with pytest.raises(InvalidRequest) as info:
        _prepare(tiny_tokenizer, **fields)
    assert expected in str(info.value)


def test_prepare_rejects_prompt_plus_max_tokens_over_context(tiny_tokenizer):
    text = "The quick brown fox jumps over the lazy dog. " * 3
    num_prompt = len(tiny_tokenizer.encode(text))
    with pytest.raises(PromptTooLong) as info:
        _prepare(tiny_tokenizer, text=text, sampling={"max_tokens": 60})
    message = str(info.value)
    assert f"prompt ({num_prompt} tokens) + max_tokens (60)" in message
    assert "context length 64" in message and f"at most {64 - num_prompt}" in message


def test_prepare_rejects_prompt_alone_over_context(tiny_tokenizer):
    with pytest.raises(PromptTooLong, match="too long: the model's context length is 64"):
        _prepare(tiny_tokenizer, text="word " * 200)


def test_prepare_applies_defaults_and_chat_template(tiny_tokenizer):
    chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content="Hi")])
    req = _prepare(tiny_tokenizer, chat=chat, model="tiny-chat")
    rendered = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert req.prompt_ids == tiny_tokenizer.encode(rendered, add_special_tokens=False)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert req.sampling.max_tokens == 16 and req.sampling.top_p == 1.0
    assert req.sampling.is_greedy and len(req.request_id) == 32


def _kserve(**tensors):
    msg = kserve_pb2.ModelInferRequest(model_name="tiny-chat")
    for name, (datatype, raw) in tensors.items():
        msg.inputs.add(name=name, datatype=datatype, shape=[1])
        msg.raw_input_contents.append(raw)
    return msg


def _bytes(text: str) -> tuple[str, bytes]:
    return "BYTES", encode_bytes([text.encode()])


def test_kserve_request_reads_triton_llm_tensors():
    params = json.dumps({"temperature": "0.5", "max_tokens": 7, "stop": "END", "top_p": 0.9})
    decoded = request_from_pb(
        _kserve(
            text_input=_bytes("Hello"),
            stream=("BOOL", b"\x01"),
            sampling_parameters=_bytes(params),
            exclude_input_in_output=("BOOL", b"\x01"),
        ),
        LIMITS,
    )
    assert decoded.generate.text == "Hello" and decoded.is_stream
    assert decoded.exclude_input_in_output is True
    sampling = decoded.generate.sampling
    assert (sampling.temperature, sampling.max_tokens, sampling.top_p) == (0.5, 7, 0.9)
    assert decoded.generate.stop == ["END"]


@pytest.mark.parametrize(
    "tensors, expected",
    [
        ({}, "input 'text_input' (BYTES) is missing"),
        ({"text_input": _bytes("hi"), "sampling_parameters": _bytes("{bad")}, "not valid JSON"),
        (
            {"text_input": _bytes("hi"), "sampling_parameters": _bytes('{"beam_width": 2}')},
            "sampling_parameters.beam_width is not supported",
        ),
        ({"text_input": _bytes("hi"), "sampling_parameters": _bytes('{"top_p": 2}')}, "top_p=2.0"),
        ({"text_input": ("BYTES", b"\x09\x00\x00\x00ab")}, "past the end"),
        ({"text_input": _bytes("hi"), "weird": _bytes("x")}, "input 'weird' is not supported"),
        (  # int() made 1 of true and 3 of 3.5
            {"text_input": _bytes("hi"), "sampling_parameters": _bytes('{"max_tokens": true}')},
            "sampling_parameters.max_tokens=True has the wrong type",
        ),
        ({"text_input": _bytes("hi"), "max_tokens": ("FP32", b"\x00\x00\x60\x40")}, "=3.5"),
        (
            {"text_input": _bytes("hi"), "sampling_parameters": _bytes('{"stop": ["\\udc80"]}')},
            "sampling_parameters.stop[0] is not valid Unicode",
        ),
    ],
)
def test_kserve_request_rejects_bad_tensors(tensors, expected):
    with pytest.raises(InvalidRequest) as info:
        request_from_pb(_kserve(**tensors), LIMITS)
    assert expected in str(info.value)


def _request(**tensors):
    """A request for the prompt "hi" with these other tensors."""
    return _kserve(text_input=_bytes("hi"), **tensors)


@pytest.mark.parametrize(
    "msg, expected",
    [
        (  # bool(b"false") is True: the prompt was dropped from the output
            _request(exclude_input_in_output=_bytes("false")),
            "input 'exclude_input_in_output' has datatype 'BYTES': expected BOOL",
        ),
        (
            _request(exclude_input_in_output=_bytes("0")),
            "input 'exclude_input_in_output' has datatype 'BYTES': expected BOOL",
        ),
        (  # streaming was turned on
            _request(stream=_bytes("false")),
            "input 'stream' has datatype 'BYTES': expected BOOL",
        ),
        (_request(stream=("BOOL", b"\x02")), "input 'stream' holds a BOOL byte other than 0"),
        (  # read as the prompt "5"
            _kserve(text_input=("INT32", b"\x05\x00\x00\x00")),
            "input 'text_input' has datatype 'INT32': expected BYTES",
        ),
        (
            _request(ignore_eos=_bytes("true")),
            "input 'ignore_eos' has datatype 'BYTES': expected BOOL",
        ),
        (
            _request(max_tokens=("BOOL", b"\x01")),
            "input 'max_tokens' has datatype 'BOOL': expected one of INT8",
        ),
        (_request(stop_token_ids=("INT32", b"\x05\x00\x00\x00")), "'stop_token_ids' is not"),
    ],
)
def test_kserve_request_refuses_a_datatype_other_than_advertised(msg, expected):
    with pytest.raises(InvalidRequest) as info:
        request_from_pb(msg, LIMITS)
    assert expected in str(info.value)


def test_kserve_request_refuses_an_input_given_twice():
    msg = _request()
    msg.inputs.add(name="text_input", datatype="BYTES", shape=[1])  # the last one won
    msg.raw_input_contents.append(encode_bytes([b"other prompt"]))
    with pytest.raises(InvalidRequest, match="input 'text_input' is given twice"):
        request_from_pb(msg, LIMITS)
    msg = _request(stream=("BOOL", b"\x01"))
    msg.inputs.add(name="stream", datatype="BOOL", shape=[1])
    msg.raw_input_contents.append(b"\x00")
    with pytest.raises(InvalidRequest, match="input 'stream' is given twice"):
        request_from_pb(msg, LIMITS)


def test_kserve_request_refuses_a_shape_or_data_it_would_misread():
    msg = _request()
    msg.inputs[0].shape[:] = [2]
    with pytest.raises(InvalidRequest, match=r"input 'text_input' has shape \[2\]: expected"):
        request_from_pb(msg, LIMITS)
    msg = _request()
    msg.inputs[0].contents.bytes_contents.append(b"another prompt")
    with pytest.raises(InvalidRequest, match="both contents and raw_input_contents"):
        request_from_pb(msg, LIMITS)


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"ignore_eos": "yes"}, "sampling_parameters.ignore_eos='yes' has the wrong type"),
        ({"ignore_eos": 2}, "sampling_parameters.ignore_eos=2 has the wrong type"),
        ({"ignore_eos": "true"}, "ignore_eos='true' has the wrong type or value: expected true"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output=1 has the wrong type"),
        ({"temperature": True}, "sampling_parameters.temperature=True has the wrong type"),
        ({"stop_token_ids": [True]}, "sampling_parameters.stop_token_ids=[True] has the wrong"),
        ({"stop_token_ids": [2.5]}, "sampling_parameters.stop_token_ids=[2.5] has the wrong"),
        ({"top_k": "-5"}, "top_k=-5 is out of range"),  # the shared SamplingParams ranges
    ],
)
def test_kserve_request_refuses_sampling_values_of_the_wrong_type(params, expected):
    msg = _request(sampling_parameters=_bytes(json.dumps(params)))
    with pytest.raises(InvalidRequest) as info:
        request_from_pb(msg, LIMITS)
    assert expected in str(info.value)


def test_kserve_request_reads_booleans_as_their_datatype_says():
    raw = request_from_pb(
        _request(stream=("BOOL", b"\x00"), exclude_input_in_output=("BOOL", b"\x00")), LIMITS
    )
    assert raw.is_stream is False and raw.exclude_input_in_output is False
    msg = kserve_pb2.ModelInferRequest(model_name="tiny-chat")  # typed contents, no raw bytes
    for name, datatype, field, value in (
        ("text_input", "BYTES", "bytes_contents", b"hi"),
        ("stream", "BOOL", "bool_contents", True),
        ("exclude_input_in_output", "BOOL", "bool_contents", False),
        ("ignore_eos", "BOOL", "bool_contents", True),
        ("max_tokens", "INT32", "int_contents", 7),
        ("temperature", "FP32", "fp32_contents", 0.5),
    ):
        tensor = msg.inputs.add(name=name, datatype=datatype, shape=[1])
        getattr(tensor.contents, field).append(value)
    typed = request_from_pb(msg, LIMITS)
    assert typed.is_stream is True and typed.exclude_input_in_output is False
    sampling = typed.generate.sampling
    assert (sampling.ignore_eos, sampling.max_tokens, sampling.temperature) == (True, 7, 0.5)
