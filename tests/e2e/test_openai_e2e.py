"""The OpenAI-compatible HTTP API end to end, with the official `openai` client, against the
`conveyor up` stack the other end-to-end tests share (SmolLM2-135M, 2 stages)."""

from __future__ import annotations

import grpc
import openai
import pytest

from services.client import ConveyorClient
from services.common.proto.conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.router.utils import wait_until

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 16, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def grpc_client(conveyor_stack):
    with ConveyorClient(conveyor_stack.router, timeout_s=300) as c:
        yield c


@pytest.fixture(scope="module")
def client(conveyor_stack):
    base_url = f"http://{conveyor_stack.http}/v1"
    with openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _stats(conveyor_stack) -> scheduler_pb2.SchedulerStats:
    with grpc.insecure_channel(conveyor_stack.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        return stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=30)


def test_e2e_openai_completion_equals_grpc_greedy(client, grpc_client, model):
    expected = grpc_client.complete(PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True)
    result = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == expected.usage["prompt_tokens"]
    assert result.usage.completion_tokens == 16
    chunks = list(client.completions.create(model=model, prompt=PROMPT, stream=True, **GREEDY))
    assert len(chunks) > 1
    assert "".join(c.choices[0].text for c in chunks) == expected.text


def test_e2e_openai_chat_equals_grpc_greedy(client, grpc_client, model):
    expected = grpc_client.complete(chat=CHAT, max_tokens=16, temperature=0.0, ignore_eos=True)
    result = client.chat.completions.create(model=model, messages=CHAT, **GREEDY)
    assert result.choices[0].message.content == expected.text
    stream = client.chat.completions.create(
        model=model,
        messages=CHAT,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == expected.usage["prompt_tokens"]


def test_e2e_openai_n_choices_and_token_logprobs(client, grpc_client, model):
    expected = grpc_client.complete(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
    result = client.completions.create(
        model=model,
        prompt=PROMPT,
        n=2,
        logprobs=2,
        temperature=0,
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in result.choices] == [expected.text] * 2
    assert result.usage.prompt_tokens == expected.usage["prompt_tokens"]  # counted once
    assert result.usage.completion_tokens == 16
    logprobs = result.choices[0].logprobs
    assert "".join(logprobs.tokens) == expected.text
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 2 and max(top.values()) == pytest.approx(value)  # greedy: the top
        assert token in top


def test_e2e_openai_stop_string(client, grpc_client, model):
    full = grpc_client.complete(PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True)
    stop = full.text.strip().split()[1]  # a word inside the greedy continuation
    result = client.completions.create(model=model, prompt=PROMPT, stop=[stop], **GREEDY)
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].text == full.text[: full.text.index(stop)]


def test_e2e_openai_disconnect_frees_blocks(client, conveyor_stack, model):
    stream = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=2000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for index, _ in enumerate(stream):
        if index == 2:
            break
    running = [key for key in _stats(conveyor_stack).request_blocks if key.startswith("anonymous/")]
    assert running  # the streamed request holds blocks
    stream.close()

    def freed():
        stats = _stats(conveyor_stack)
        return not set(running) & set(stats.request_blocks) and stats.num_running == 0

    wait_until(freed, timeout_s=60, what="the disconnected request's blocks to be freed")


def test_e2e_openai_min_tokens_holds_off_eos(client, model, conveyor_stack):
    """A prompt whose greedy answer ends on EOS after 11 tokens gets min_tokens=16 tokens,
    as transformers' own min_new_tokens (EOS masked out of sampling) gives them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt, greedy = "The end.", {"temperature": 0, "max_tokens": 24}
    early = client.completions.create(model=model, prompt=prompt, **greedy)
    assert early.choices[0].finish_reason == "stop"
    assert early.usage.completion_tokens < 16
    held = client.completions.create(
        model=model, prompt=prompt, extra_body={"min_tokens": 16}, **greedy
    )
    assert held.usage.completion_tokens >= 16
    assert held.choices[0].text.startswith(early.choices[0].text)
    tokenizer = AutoTokenizer.from_pretrained(conveyor_stack.model_dir)
    hf = AutoModelForCausalLM.from_pretrained(conveyor_stack.model_dir, dtype=torch.float32)
    input_ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        out = hf.generate(input_ids, do_sample=False, min_new_tokens=16, max_new_tokens=24)
    expected = out[0, input_ids.shape[1] :].tolist()
    assert held.usage.completion_tokens == len(expected)
    assert held.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
