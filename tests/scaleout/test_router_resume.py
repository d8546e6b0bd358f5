"""Generation.Resume: a client whose router dies mid-stream picks the stream up through
another router (docs/scale-out.md), and only its own principal may (real processes: Redis,
two SmolLM2 pipelines, two routers with API keys)."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest
import torch

from services.client.client import AsyncConveyorClient, ConveyorClient
from services.router.api_keys import format_line, new_key
from tests.scaleout.utils import ScaleOutStack

PROMPT = "Once upon a time, in a small village by the sea,"
MAX_TOKENS = 48
"""Long enough that the stream is still running when its router is killed."""


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """(key file, key by principal) for alice and bob."""
    keys = {name: new_key() for name in ("alice", "bob")}
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text("".join(format_line(k, n, None, 0) + "\n" for n, k in keys.items()))
    return str(path), keys


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir) -> list[int]:
    from services.router.tokenizer import Tokenizer

    return Tokenizer.from_dir(smollm2_dir).encode(PROMPT, add_special_tokens=False)


@pytest.fixture(scope="module")
def resume_stack(smollm2_dir, tmp_path_factory, keys, prompt_ids):
    workdir = tmp_path_factory.mktemp("resume")
    stack = ScaleOutStack(smollm2_dir, workdir, router_args=("--api-key-file", keys[0]))
    try:
        import transformers

        from tests.integration.weights_utils import hf_greedy

        torch.set_num_threads(2)
        model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
        reference = hf_greedy(model.eval(), [prompt_ids], MAX_TOKENS)[0][0]
        stack.wait_serving()
        yield stack, reference
    except BaseException:
        print((workdir / "stack.log").read_text()[-8000:])
        raise
    finally:
        stack.stop()


async def _async_code(address: str, api_key: str, *args) -> grpc.StatusCode | None:
    async with AsyncConveyorClient(address, timeout_s=120, api_key=api_key) as client:
        try:
            async for _ in client.resume(*args):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return None


def _code(fn, *args) -> grpc.StatusCode | None:
    try:
        list(fn(*args))
    except grpc.RpcError as exc:
        return exc.code()
    return None


def test_resume_through_another_router_after_a_kill(resume_stack, keys, prompt_ids, smollm2_dir):
    from services.router.tokenizer import Tokenizer

    stack, reference = resume_stack
    api_keys = keys[1]
    router_a, router_b = stack.routers["prefix"], stack.routers["round-robin"]
    alice_a = ConveyorClient(router_a, timeout_s=120, api_key=api_keys["alice"])
    alice_b = ConveyorClient(router_b, timeout_s=120, api_key=api_keys["alice"])
    bob_b = ConveyorClient(router_b, timeout_s=120, api_key=api_keys["bob"])
    request_id = "story-1"

    seen, texts = [], []
    stream = alice_a.generate(
        token_ids=prompt_ids,
        temperature=0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        request_id=request_id,
    )
    for delta in stream:
        assert delta.offset == len(seen)
        seen.extend(delta.token_ids)
        texts.append(delta.text)
        if len(seen) >= 4:
            break
    stack.kill_router("prefix")  # mid-stream: the request goes on in its pipeline
    offset = len(seen)

    # Ids live in the principal's namespace: bob's "story-1" does not exist.
    assert _code(bob_b.resume, request_id, offset) is grpc.StatusCode.NOT_FOUND
    bob_async = _async_code(router_b, api_keys["bob"], request_id, offset)
    assert asyncio.run(bob_async) is grpc.StatusCode.NOT_FOUND
    assert _code(alice_b.resume, "no-such-request", 0) is grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as refused:
        list(alice_b.resume(request_id, 10_000))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    # The client's own offset (the router asks for a few tokens before it, as context).
    assert re.search(r"offset=10000 is beyond .* it has \d+ tokens", refused.value.details())

    last = None
    for delta in alice_b.resume(request_id, offset):
        assert delta.request_id == request_id
        assert delta.offset == len(seen)  # no gap, no duplicate
        seen.extend(delta.token_ids)
        texts.append(delta.text)
        last = delta
    assert seen == reference
    assert last is not None and last.finish_reason == "length"
    assert last.usage["completion_tokens"] == MAX_TOKENS
    assert last.usage["prompt_tokens"] == len(prompt_ids)
    assert "".join(texts) == Tokenizer.from_dir(smollm2_dir).decode(
        reference, skip_special_tokens=True
    )
