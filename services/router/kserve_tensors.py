"""KServe v2 tensors of Triton's LLM convention <-> the router's GenerateInput.

Inputs (as Triton's vLLM backend): `text_input` BYTES, `stream` BOOL,
`sampling_parameters` BYTES (a JSON object with vLLM's names), `exclude_input_in_output`
BOOL; sampling keys may also come as tensors of their own (`max_tokens` INT32, ...).
Output: `text_output` BYTES. BYTES elements in raw contents are each prefixed by their
4-byte little-endian length. The JSON of `sampling_parameters` is bounded in size and in
nesting depth before it is parsed (the parser recurses once per level).

As Triton does, each input is checked against what ModelMetadata advertises before its
value is read: a known name, given once, of the advertised datatype and shape [1]. A value
is never coerced across types (a BYTES "false" is not a BOOL), so that no input can be
misread silently.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidRequest
from services.common.limits import check_unicode, clip
from services.common.proto.inference import grpc_service_pb2 as pb
from services.common.sampling import SamplingParams
from services.router.request import GenerateInput, ModelLimits

_FIXED = {  # datatype -> (struct code, InferTensorContents field)
    "BOOL": ("?", "bool_contents"),
    "INT8": ("b", "int_contents"),
    "INT16": ("h", "int_contents"),
    "INT32": ("i", "int_contents"),
    "INT64": ("q", "int64_contents"),
    "UINT8": ("B", "uint_contents"),
    "UINT16": ("H", "uint_contents"),
    "UINT32": ("I", "uint_contents"),
    "UINT64": ("Q", "uint64_contents"),
    "FP32": ("f", "fp32_contents"),
    "FP64": ("d", "fp64_contents"),
}
_FLOAT_KEYS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_INT_KEYS = ("top_k", "seed", "max_tokens", "min_tokens", "logprobs")
_BOOL_KEYS = ("ignore_eos", "include_stop_str_in_output")
SAMPLING_KEYS = (*_FLOAT_KEYS, *_INT_KEYS, *_BOOL_KEYS, "stop", "stop_token_ids", "n")
INPUT_DATATYPES = {  # what ModelMetadata and ModelConfig advertise, each of shape [1]
    "text_input": "BYTES",
    "stream": "BOOL",
    "sampling_parameters": "BYTES",
    "exclude_input_in_output": "BOOL",
}
INPUT_NAMES = tuple(INPUT_DATATYPES)
REQUIRED_INPUTS = ("text_input",)
_NUMBER_TYPES = tuple(datatype for datatype in _FIXED if datatype != "BOOL")
KEY_DATATYPES = {  # sampling keys as tensors of their own (TensorRT-LLM's habit)
    **{key: _NUMBER_TYPES for key in (*_FLOAT_KEYS, *_INT_KEYS, "n")},
    **{key: ("BOOL",) for key in _BOOL_KEYS},
    "stop": ("BYTES",),
}
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(r"[\[\]{}]")


@dataclass(slots=True)
class KServeRequest:
    """A decoded ModelInferRequest."""

    generate: GenerateInput
    is_stream: bool
    exclude_input_in_output: bool | None  # None: not given


def decode_bytes(raw: bytes) -> list[bytes]:
    """Elements of a raw BYTES tensor (each 4-byte LE length-prefixed)."""
    items, pos = [], 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise InvalidRequest("a BYTES tensor is truncated: a 4-byte length prefix is cut")
        (size,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + size > len(raw):
            raise InvalidRequest(f"a BYTES tensor element claims {size} bytes, past the end")
        items.append(raw[pos : pos + size])
        pos += size
    return items


def encode_bytes(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def _check_tensor(tensor, has_raw: bool) -> None:
    """Raises InvalidRequest unless the tensor is one the model takes: a known name, of its
    datatype, holding one element, its data in one place."""
    name = tensor.name
    allowed = (INPUT_DATATYPES[name],) if name in INPUT_DATATYPES else KEY_DATATYPES.get(name)
    if allowed is None:
        raise InvalidRequest(
            f"input {clip(name)} is not supported: inputs are {', '.join(INPUT_NAMES)} "
            f"(and sampling keys as tensors: {', '.join(KEY_DATATYPES)})"
        )
    if tensor.datatype not in allowed:
        expected = allowed[0] if len(allowed) == 1 else f"one of {', '.join(allowed)}"
        raise InvalidRequest(
            f"input {clip(name)} has datatype {clip(tensor.datatype)}: expected {expected}"
        )
    if any(dim != 1 for dim in tensor.shape):
        raise InvalidRequest(
            f"input {clip(name)} has shape {clip(list(tensor.shape))}: expected [1] "
            "(one element; batching is not supported)"
        )
    if has_raw and tensor.contents.ByteSize():
        raise InvalidRequest(
            f"input {clip(name)} has both contents and raw_input_contents: give its data once"
        )


def _tensor_values(tensor, raw: bytes | None) -> list[Any]:
    datatype = tensor.datatype
    if datatype == "BYTES":
        return decode_bytes(raw) if raw is not None else list(tensor.contents.bytes_contents)
    code, field_name = _FIXED[datatype]
    if raw is None:
        return list(getattr(tensor.contents, field_name))
    size = struct.calcsize(code)
    if len(raw) % size:
        raise InvalidRequest(
            f"input {clip(tensor.name)}: {len(raw)} raw bytes is not a whole "
            f"number of {datatype} elements"
        )
    if datatype == "BOOL" and raw and max(raw) > 1:  # struct would read 2 as true
        raise InvalidRequest(
            f"input {clip(tensor.name)} holds a BOOL byte other than 0 (false) or 1 (true)"
        )
    return list(struct.unpack(f"<{len(raw) // size}{code}", raw))


def decode_inputs(msg: pb.ModelInferRequest) -> dict[str, Any]:
    """name -> the single element of each input tensor, of the type its datatype says
    (bytes, bool, int or float); raises InvalidRequest."""
    raws = list(msg.raw_input_contents)
    if raws and len(raws) != len(msg.inputs):
        raise InvalidRequest(
            f"raw_input_contents has {len(raws)} entries for "
            f"{len(msg.inputs)} inputs: give one per input"
        )
    values: dict[str, Any] = {}
    for index, tensor in enumerate(msg.inputs):
        if tensor.name in values:
            raise InvalidRequest(f"input {clip(tensor.name)} is given twice: give it once")
        _check_tensor(tensor, has_raw=bool(raws))
        elements = _tensor_values(tensor, raws[index] if raws else None)
        if len(elements) != 1:
            raise InvalidRequest(
                f"input {clip(tensor.name)} has {len(elements)} elements: "
                "give exactly one (batching is not supported)"
            )
        values[tensor.name] = elements[0]
    return values


def _text(value: Any, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"input {clip(name)} is not valid UTF-8: {exc}") from exc
    return str(value)


def json_depth(text: str) -> int:
    """How deeply arrays and objects nest in a JSON text, counted without parsing it."""
    depth = deepest = 0
    for bracket in _JSON_BRACKET.findall(_JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _parse_json(value: Any, limits: ModelLimits) -> dict[str, Any]:
    """The `sampling_parameters` object, bounded in size and depth before it is parsed."""
    size = len(value) if isinstance(value, bytes) else len(str(value).encode("utf-8"))
    if size > limits.max_json_bytes:
        raise InvalidRequest(
            f"sampling_parameters has {size} bytes, too large: at most "
            f"{limits.max_json_bytes} (--max-json-bytes)"
        )
    text = _text(value, "sampling_parameters")
    depth = json_depth(text)
    if depth > limits.max_json_depth:
        raise InvalidRequest(
            f"sampling_parameters nests {depth} levels deep, too deep: at most "
            f"{limits.max_json_depth} (--max-json-depth)"
        )
    try:
        options = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, or an int too long
        raise InvalidRequest(f"sampling_parameters is not valid JSON: {exc}") from exc
    if not isinstance(options, dict):
        raise InvalidRequest("sampling_parameters must be a JSON object")
    check_unicode(options, "sampling_parameters")
    return options


def _to_int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise TypeError("expected an integer")  # int() would make 1 of true, 3 of 3.5
    return int(value)


def _convert(key: str, value: Any) -> Any:
    """One sampling option as SamplingParams takes it. Numbers may come as strings ("0.7",
    as Triton's vLLM backend reads them); booleans only as true or false. Ranges are
    SamplingParams' to check, as for every API."""
    try:
        if key in _FLOAT_KEYS:
            if isinstance(value, bool):
                raise TypeError("expected a number")  # float() would make 1.0 of true
            return float(value)
        if key in _INT_KEYS or key == "n":
            return _to_int(value)
        if key in _BOOL_KEYS:
            if not isinstance(value, bool):
                raise TypeError("expected true or false")
            return value
        if key == "stop":
            if isinstance(value, str):
                return [value]
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return list(value)
            raise TypeError("expected a string or a list of strings")
        if not isinstance(value, list):  # stop_token_ids
            raise TypeError("expected a list of integers")
        return [_to_int(v) for v in value]
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidRequest(
            f"sampling_parameters.{key}={clip(value)} has the wrong type or value: {exc}"
        ) from exc


def sampling_options(values: dict[str, Any], limits: ModelLimits) -> dict[str, Any]:
    """vLLM sampling options from the JSON tensor, overridden by per-key tensors."""
    options: dict[str, Any] = {}
    if "sampling_parameters" in values:
        options = _parse_json(values["sampling_parameters"], limits)
    unknown = [k for k in options if k not in SAMPLING_KEYS]
    if unknown:
        raise InvalidRequest(
            f"sampling_parameters.{unknown[0][:60]} is not supported: allowed "
            f"keys are {', '.join(SAMPLING_KEYS)}"
        )
    for key in SAMPLING_KEYS:
        if key in values:
            options[key] = (
                _text(values[key], key) if isinstance(values[key], bytes) else values[key]
            )
    return {key: _convert(key, value) for key, value in options.items()}


def request_from_pb(msg: pb.ModelInferRequest, limits: ModelLimits) -> KServeRequest:
    """Decodes a ModelInferRequest of the LLM convention; raises InvalidRequest."""
    values = decode_inputs(msg)
    if "text_input" not in values:
        raise InvalidRequest("input 'text_input' (BYTES) is missing: it holds the prompt")
    options = sampling_options(values, limits)
    if options.pop("n", 1) != 1:
        raise InvalidRequest("sampling_parameters.n must be 1: one output per request")
    stop = options.pop("stop", [])
    include_stop = options.pop("include_stop_str_in_output", False)
    exclude = values.get("exclude_input_in_output")
    return KServeRequest(
        generate=GenerateInput(
            sampling=SamplingParams(**options),
            text=_text(values["text_input"], "text_input"),
            stop=stop,
            include_stop_str_in_output=include_stop,
        ),
        is_stream=values.get("stream", False),
        exclude_input_in_output=exclude,
    )


def text_response(model_name: str, request_id: str, text: str) -> pb.ModelInferResponse:
    """A response whose `text_output` BYTES tensor holds `text`."""
    return pb.ModelInferResponse(
        model_name=model_name,
        model_version="1",
        id=request_id,
        outputs=[
            pb.ModelInferResponse.InferOutputTensor(name="text_output", datatype="BYTES", shape=[1])
        ],
        raw_output_contents=[encode_bytes([text.encode("utf-8")])],
    )
