"""The public APIs end to end: `conveyor up` (SmolLM2-135M, 2 stages) behind the router."""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from services.client import AsyncConveyorClient, ConveyorClient
from services.common.proto.conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.router.tokenizer import Tokenizer
from tests.e2e.conftest import MAX_MODEL_LEN
from tests.router.utils import wait_until

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
GRPCURL = Path(sys.executable).parent / "grpcurl"


@pytest.fixture(scope="module")
def client(conveyor_stack):
    with ConveyorClient(conveyor_stack.router, timeout_s=300) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(conveyor_stack) -> Tokenizer:
    return Tokenizer.from_dir(conveyor_stack.model_dir)


def _greedy(client, prompt=PROMPT, max_tokens=16, **kwargs):
    return client.complete(
        prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs
    )


def _stats(conveyor_stack) -> scheduler_pb2.SchedulerStats:
    with grpc.insecure_channel(conveyor_stack.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        return stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=30)


def test_e2e_generate_equals_transformers_greedy(client, conveyor_stack, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    deltas = list(client.generate(PROMPT, max_tokens=16, ignore_eos=True))
    assert len(deltas) > 1 and deltas[-1].finish_reason == "length"
    ids = [i for d in deltas for i in d.token_ids]
    model = AutoModelForCausalLM.from_pretrained(conveyor_stack.model_dir, dtype=torch.float32)
    input_ids = torch.tensor([tokenizer.encode(PROMPT)])
    expected = []
    with torch.no_grad():
        for _ in range(16):
            next_id = int(model(input_ids).logits[0, -1].argmax())
            expected.append(next_id)
            input_ids = torch.cat([input_ids, torch.tensor([[next_id]])], dim=1)
    assert ids == expected
    assert "".join(d.text for d in deltas) == tokenizer.decode(expected, skip_special_tokens=True)
    assert deltas[-1].usage["completion_tokens"] == 16


def test_e2e_chat_streams_through_the_template(client, tokenizer):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    result = client.complete(chat=chat, max_tokens=24, temperature=0.0)
    assert result.finish_reason in ("stop", "length") and result.text.strip()
    assert "<|im_end|>" not in result.text
    assert result.usage["prompt_tokens"] == len(client.tokenize(chat=chat))


@pytest.mark.skipif(not GRPCURL.exists(), reason="grpcurl not installed")
def test_e2e_grpcurl_lists_and_calls(conveyor_stack, client):
    def grpcurl(*args):
        done = subprocess.run(
            [str(GRPCURL), "-plaintext", *args], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    address = conveyor_stack.router
    assert {
        "conveyor.v1.Generation",
        "inference.GRPCInferenceService",
        "grpc.health.v1.Health",
    } <= set(grpcurl(address, "list").split())
    out = grpcurl(
        "-d",
        json.dumps({"text": PROMPT, "sampling": {"max_tokens": 16, "ignore_eos": True}}),
        address,
        "conveyor.v1.Generation/Generate",
    )
    messages = [json.loads(m) for m in out.replace("}\n{", "}\x00{").split("\x00")]
    assert "".join(m.get("text", "") for m in messages) == _greedy(client).text
    assert json.loads(grpcurl(address, "grpc.health.v1.Health/Check")) == {"status": "SERVING"}


def _triton_inputs(prompt: str, stream: bool):
    import tritonclient.grpc as triton

    params = json.dumps({"max_tokens": 16, "temperature": 0, "ignore_eos": True})
    tensors = []
    for name, datatype, value in (
        ("text_input", "BYTES", prompt.encode()),
        ("sampling_parameters", "BYTES", params.encode()),
        ("stream", "BOOL", stream),
        ("exclude_input_in_output", "BOOL", True),
    ):
        tensor = triton.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
        tensors.append(tensor)
    return tensors


def test_e2e_tritonclient_matches_generate(conveyor_stack, client):
    import tritonclient.grpc as triton

    expected = _greedy(client).text
    name = conveyor_stack.model_dir.name
    tc = triton.InferenceServerClient(conveyor_stack.router)
    try:
        assert tc.is_server_ready() and tc.is_model_ready(name)
        result = tc.infer(name, _triton_inputs(PROMPT, stream=False))
        assert result.as_numpy("text_output")[0].decode() == expected
        responses: queue.Queue = queue.Queue()
        tc.start_stream(callback=lambda result, error: responses.put((result, error)))
        tc.async_stream_infer(name, _triton_inputs(PROMPT, stream=True), request_id="s1")
        pieces = []
        while True:
            result, error = responses.get(timeout=300)
            assert error is None, error
            pieces.append(result.as_numpy("text_output")[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        tc.stop_stream()
    finally:
        tc.close()
    assert "".join(pieces) == expected and len(pieces) > 1


def test_e2e_invalid_fields_refused_while_others_are_served(conveyor_stack, client):
    outcome = {}

    def long_request():
        outcome["result"] = _greedy(client, max_tokens=48)

    worker = threading.Thread(target=long_request)
    worker.start()
    cases = [
        ({"prompt": ""}, "text is empty"),
        ({"prompt": "x", "top_p": 2.0}, "top_p=2.0"),
        ({"prompt": "x", "temperature": -1.0}, "temperature=-1.0"),
        ({"prompt": "x", "max_tokens": 10_000}, "max_tokens (10000)"),
        ({"prompt": "x", "model": "gpt-4"}, "model='gpt-4'"),
        ({"prompt": "x", "stop": ["s"] * 17}, "stop has 17 strings"),
    ]
    for kwargs, expected in cases:
        with pytest.raises(grpc.RpcError) as info:
            client.complete(**kwargs)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert expected in info.value.details()
    worker.join(timeout=300)
    assert outcome["result"].finish_reason == "length"
    assert len(outcome["result"].token_ids) == 48


def test_e2e_the_stacks_max_model_len_is_the_routers(client):
    """`conveyor up --max-model-len` reaches the router, which advertises it and refuses
    what does not fit with INVALID_ARGUMENT (it advertised the model's 8192 and accepted
    requests the scheduler then cut short at the stack's length)."""
    assert [m["max_model_len"] for m in client.list_models()] == [MAX_MODEL_LEN]
    with pytest.raises(grpc.RpcError) as info:
        _greedy(client, max_tokens=MAX_MODEL_LEN)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"context length {MAX_MODEL_LEN}" in info.value.details()


def test_e2e_cancel_frees_blocks(conveyor_stack, client):
    stream = client.generate(PROMPT, max_tokens=2000, ignore_eos=True, request_id="e2e-cancel")
    for index, _ in enumerate(stream):
        if index == 2:
            break
    key = "anonymous/e2e-cancel"  # the scheduler's id: principal/request id
    assert key in _stats(conveyor_stack).request_blocks
    stream.close()

    def freed():
        stats = _stats(conveyor_stack)
        return key not in stats.request_blocks and stats.num_running == 0

    wait_until(freed, timeout_s=60, what="the cancelled request's blocks to be freed")


def test_e2e_64_concurrent_streams_complete(conveyor_stack):
    async def one(client, index):
        deltas = [
            d
            async for d in client.generate(
                f"Story {index}: once upon a time", max_tokens=8, ignore_eos=True
            )
        ]
        return deltas

    async def main():
        async with AsyncConveyorClient(conveyor_stack.router, timeout_s=600) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64
    for deltas in results:
        assert deltas[-1].finish_reason == "length"
        assert sum(len(d.token_ids) for d in deltas) == 8


def test_e2e_stop_string_spanning_two_tokens(client, tokenizer):
    full = _greedy(client)
    pieces = [tokenizer.decode([i]) for i in full.token_ids]
    stop = None
    for k in range(len(pieces) - 1):
        a, b = pieces[k], pieces[k + 1]
        if len(a.strip()) >= 2 and len(b.strip()) >= 2:
            stop = a[-2:] + b[:2]
            break
    assert stop is not None, f"no two adjacent multi-character tokens in {pieces}"
    result = _greedy(client, stop=[stop])
    assert result.finish_reason == "stop"
    assert result.text == full.text[: full.text.index(stop)]


def test_e2e_multibyte_text_streams_whole_characters(client, tokenizer):
    deltas = list(client.generate("Emoji row: 🙂🙂🙂🙂🙂🙂🙂🙂", max_tokens=16, ignore_eos=True))
    ids = [i for d in deltas for i in d.token_ids]
    text = "".join(d.text for d in deltas)
    assert any(ord(ch) > 127 for ch in text), f"no multi-byte output to check: {text!r}"
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "no character split over tokens"
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    # Only a character cut by max_tokens at the very end may show as U+FFFD (as in decode).
    assert all("\ufffd" not in d.text for d in deltas[:-1])
    assert "\ufffd" not in text.rstrip("\ufffd")
