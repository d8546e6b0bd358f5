"""KServe v2 / Triton clients work against the router unchanged."""

from __future__ import annotations

import json
import queue

import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.service_pb2 as triton_pb2
from tritonclient.utils import InferenceServerException

from services.common.proto.inference import grpc_service_pb2 as ours
from tests.router.utils import ANSWER

_SERVICE = "GRPCInferenceService"


def _implemented_messages(requests_only: bool = False) -> set[str]:
    """Every message the implemented rpcs carry (only what they receive: requests_only)."""
    service = ours.DESCRIPTOR.services_by_name[_SERVICE]
    names = set()

    def add(message):
        if message.full_name in names:
            return
        names.add(message.full_name)
        for fd in message.fields:
            if fd.message_type is not None:
                add(fd.message_type)
        for nested in message.nested_types:
            add(nested)

    for method in service.methods:
        add(method.input_type)
        if not requests_only:
            add(method.output_type)
    return names


def test_kserve_proto_is_wire_compatible_with_tritonclient():
    assert ours.DESCRIPTOR.package == triton_pb2.DESCRIPTOR.package == "inference"
    theirs_service = triton_pb2.DESCRIPTOR.services_by_name[_SERVICE]
    for method in ours.DESCRIPTOR.services_by_name[_SERVICE].methods:
        theirs = theirs_service.methods_by_name[method.name]
        assert method.input_type.full_name == theirs.input_type.full_name
        assert method.output_type.full_name == theirs.output_type.full_name
        assert (method.client_streaming, method.server_streaming) == (
            theirs.client_streaming,
            theirs.server_streaming,
        )
    pool = triton_pb2.DESCRIPTOR.pool
    received = _implemented_messages(requests_only=True)
    checked = 0
    for full_name in sorted(_implemented_messages()):
        mine = ours.DESCRIPTOR.pool.FindMessageTypeByName(full_name)
        theirs = pool.FindMessageTypeByName(full_name)
        for fd in mine.fields:
            other = theirs.fields_by_name[fd.name]
            assert (fd.number, fd.type, fd.is_repeated) == (
                other.number,
                other.type,
                other.is_repeated,
            ), f"{full_name}.{fd.name}"
            if fd.message_type is not None:
                assert fd.message_type.full_name == other.message_type.full_name
            checked += 1
        # Fields we left out of a request would be dropped silently; make sure none are. A
        # response may fill a subset (ModelConfig: a client reads the rest as unset).
        if full_name in received:
            assert set(mine.fields_by_name) == set(theirs.fields_by_name), full_name
    assert checked > 40


@pytest.fixture()
def triton_client(router):
    client = triton.InferenceServerClient(router.address)
    yield client
    client.close()


def _inputs(prompt: str, params: dict, stream: bool | None = None, exclude: bool | None = None):
    tensors = []

    def add(name, datatype, value):
        tensor = triton.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
        tensors.append(tensor)

    add("text_input", "BYTES", prompt.encode())
    add("sampling_parameters", "BYTES", json.dumps(params).encode())
    if stream is not None:
        add("stream", "BOOL", stream)
    if exclude is not None:
        add("exclude_input_in_output", "BOOL", exclude)
    return tensors


def test_kserve_health_and_metadata(fake, triton_client, tiny_model_dir):
    name = tiny_model_dir.name
    assert triton_client.is_server_live() and triton_client.is_server_ready()
    assert triton_client.is_model_ready(name)
    assert not triton_client.is_model_ready("not-a-model")
    assert triton_client.get_server_metadata().name == "conveyor"
    meta = triton_client.get_model_metadata(name)
    assert [t.name for t in meta.inputs][:2] == ["text_input", "stream"]
    assert [(t.name, t.datatype) for t in meta.outputs] == [("text_output", "BYTES")]


def test_kserve_model_config_is_a_decoupled_llm(fake, triton_client, tiny_model_dir):
    config = triton_client.get_model_config(tiny_model_dir.name).config
    assert config.name == tiny_model_dir.name and config.backend == "conveyor"
    assert config.model_transaction_policy.decoupled  # streams: many responses per request
    inputs = {t.name: t for t in config.input}
    assert list(inputs) == [
        "text_input",
        "stream",
        "sampling_parameters",
        "exclude_input_in_output",
    ]
    assert inputs["text_input"].data_type == triton_pb2.model__config__pb2.TYPE_STRING
    assert not inputs["text_input"].optional and inputs["stream"].optional
    assert [(t.name, list(t.dims)) for t in config.output] == [("text_output", [1])]
    as_json = triton_client.get_model_config(tiny_model_dir.name, as_json=True)["config"]
    assert as_json["model_transaction_policy"] == {"decoupled": True}
    with pytest.raises(InferenceServerException, match="not-a-model"):
        triton_client.get_model_config("not-a-model")


def test_kserve_model_infer_returns_prompt_and_text(fake, triton_client, tiny_model_dir):
    name = tiny_model_dir.name
    result = triton_client.infer(name, _inputs("Q: ", {"max_tokens": 200}))
    assert result.as_numpy("text_output")[0].decode() == "Q: " + ANSWER
    result = triton_client.infer(
        name, _inputs("Q: ", {"max_tokens": 200, "stop": ["fox"]}, exclude=True)
    )
    assert result.as_numpy("text_output")[0].decode() == ANSWER[: ANSWER.index("fox")]


def test_kserve_model_infer_errors_name_the_field(fake, triton_client, tiny_model_dir):
    with pytest.raises(InferenceServerException) as info:
        triton_client.infer(tiny_model_dir.name, _inputs("Q", {"temperature": -1}))
    assert "StatusCode.INVALID_ARGUMENT" in str(info.value.status())
    assert "temperature=-1.0" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        triton_client.infer("nope", _inputs("Q", {}))
    assert "StatusCode.NOT_FOUND" in str(info.value.status())


def test_kserve_stream_infer_streams_deltas_per_request(fake, triton_client, tiny_model_dir):
    results: queue.Queue = queue.Queue()
    triton_client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for request_id in ("a", "b"):
            triton_client.async_stream_infer(
                tiny_model_dir.name,
                _inputs("Q", {"max_tokens": 200}, stream=True),
                request_id=request_id,
                enable_empty_final_response=True,
            )
        triton_client.async_stream_infer(
            tiny_model_dir.name, _inputs("Q", {"top_p": 7}, stream=True), request_id="bad"
        )
        texts = {"a": [], "b": []}
        finals, errors = set(), []
        while len(finals) < 2 or not errors:
            result, error = results.get(timeout=30)
            if error is not None:
                errors.append(error)
                continue
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                finals.add(response.id)
                assert not response.outputs  # the empty final response asked for
                continue
            texts[response.id].append(result.as_numpy("text_output")[0].decode())
    finally:
        triton_client.stop_stream()
    assert finals == {"a", "b"}
    for pieces in texts.values():
        assert "".join(pieces) == ANSWER and len(pieces) > 5
    assert "top_p=7.0" in errors[0].message()


def test_kserve_model_infer_refuses_an_input_it_would_misread(fake, triton_client, tiny_model_dir):
    name = tiny_model_dir.name
    result = triton_client.infer(name, _inputs("Q: ", {"max_tokens": 200}, exclude=False))
    assert result.as_numpy("text_output")[0].decode() == "Q: " + ANSWER
    as_string = triton.InferInput("exclude_input_in_output", [1], "BYTES")
    as_string.set_data_from_numpy(np.array([b"false"], dtype=object))  # was read as true
    with pytest.raises(InferenceServerException) as info:
        triton_client.infer(name, _inputs("Q: ", {"max_tokens": 200}) + [as_string])
    assert "StatusCode.INVALID_ARGUMENT" in str(info.value.status())
    assert "'exclude_input_in_output' has datatype 'BYTES': expected BOOL" in info.value.message()
    with pytest.raises(InferenceServerException) as info:  # was read as false
        triton_client.infer(name, _inputs("Q: ", {"max_tokens": 200, "ignore_eos": "yes"}))
    assert "StatusCode.INVALID_ARGUMENT" in str(info.value.status())
    assert "sampling_parameters.ignore_eos='yes' has the wrong type" in info.value.message()
