"""OpenAI request bodies to the core's inputs, and outputs to usage (pure, no server)."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidRequest, ModelNotFound
from services.common.sampling import MAX_SEED
from services.common.step import TokenLogprobs
from services.router.http import convert, schemas
from services.router.output import OutputDelta, Usage
from services.router.request import ModelLimits

LIMITS = ModelLimits(name="m", max_model_len=64, vocab_size=100)


def completion(**fields) -> schemas.CompletionRequest:
    return schemas.CompletionRequest(**{"prompt": "x", **fields})


def test_convert_prompt_forms_and_choice_order():
    body = completion(prompt=["a", "b"], n=2, seed=MAX_SEED, max_tokens=3)
    inputs = convert.completion_inputs(body, max_choices=64)
    assert [i.text for i in inputs] == ["a", "a", "b", "b"]
    assert [i.sampling.seed for i in inputs] == [MAX_SEED, 0, MAX_SEED, 0]  # seed + i, wrapped
    assert convert.completion_prompts([1, 2]) == [(None, [1, 2])]
    assert convert.completion_prompts([[1], [2, 3]]) == [(None, [1]), (None, [2, 3])]
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        convert.completion_prompts([])


def test_convert_defaults_are_openais():
    (one,) = convert.completion_inputs(completion(), max_choices=1)
    assert (one.sampling.max_tokens, one.sampling.temperature) == (16, 1.0)
    chat = schemas.ChatCompletionRequest(
        messages=[{"role": "developer", "content": [{"type": "text", "text": "be brief"}]}],
        logprobs=True,
        top_logprobs=3,
    )
    (turn,) = convert.chat_input(chat, max_tokens=5, max_choices=1)[0].chat
    assert (turn.role, turn.content) == ("system", "be brief")
    assert convert.chat_input(chat, 5, 1)[0].sampling.logprobs == 3
    assert convert.chat_input(chat, 5, 1)[0].sampling.min_tokens == 0
    (one,) = convert.completion_inputs(completion(min_tokens=4, max_tokens=8), max_choices=1)
    assert one.sampling.min_tokens == 4
    with pytest.raises(InvalidRequest, match=r"min_tokens=17 .* max_tokens=16"):
        convert.completion_inputs(completion(min_tokens=17), max_choices=1)


def test_convert_refuses_what_it_would_ignore():
    with pytest.raises(InvalidRequest, match=r"unsupported parameter\(s\): logit_bias, suffix"):
        convert.completion_inputs(completion(suffix="z", logit_bias={"1": 1}), 1)
    convert.completion_inputs(completion(logit_bias=None), 1)  # null is "not sent"
    with pytest.raises(InvalidRequest, match="best_of"):
        convert.completion_inputs(completion(best_of=3), 1)
    with pytest.raises(InvalidRequest, match="stream_options is only allowed with stream"):
        convert.completion_inputs(completion(stream_options={"include_usage": True}), 1)
    with pytest.raises(InvalidRequest, match=r"2000000000 choices .* at most 64"):
        convert.completion_inputs(completion(n=1_000_000_000, prompt=["a", "b"]), 64)
    with pytest.raises(ModelNotFound, match="does not exist"):
        convert.check_model("gpt-4", LIMITS)
    convert.check_model(None, LIMITS)


def test_convert_refuses_message_fields_it_would_ignore():
    """A message's tool_calls, name or tool_call_id were dropped without a word (the model
    saw an empty assistant turn); an echo on chat named logprobs nobody asked for."""
    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "x", "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "1", "tool_call_id": "a"},
    ]
    chat = schemas.ChatCompletionRequest(messages=messages)
    with pytest.raises(InvalidRequest) as refused:
        convert.chat_input(chat, 5, 1)
    assert str(refused.value) == (
        "unsupported parameter(s): messages[0].name, messages[1].tool_calls, "
        "messages[2].tool_call_id"
    )
    plain = [{"role": "user", "content": "x", "name": None}]  # null is "not sent"
    convert.chat_input(schemas.ChatCompletionRequest(messages=plain), 5, 1)
    echo = schemas.ChatCompletionRequest(messages=plain, echo=True)
    with pytest.raises(InvalidRequest, match=r"^unsupported parameter\(s\): echo$"):
        convert.chat_input(echo, 5, 1)


def test_convert_usage_counts_each_prompt_once():
    def last(prompt: int, completion: int) -> OutputDelta:
        return OutputDelta("", [], 0, finish_reason="stop", usage=Usage(prompt, completion, 1))

    usage = convert.usage_of([last(5, 2), last(5, 3), last(7, 4), last(7, 1)], n=2)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (12, 10, 22)
    assert usage.prompt_tokens_details.cached_tokens == 2


def test_logprobs_bytes_and_top_tokens_that_read_alike(tiny_tokenizer):
    """Chat `bytes` are each token's own bytes (joined, the text, also a character split
    across byte tokens); completions' top_logprobs keep the likelier of tokens that read
    alike (all byte tokens read U+FFFD), not the last one."""
    ids = tiny_tokenizer.encode("ok 🎉", add_special_tokens=False)
    byte_ids = [i for i in ids if tiny_tokenizer.decode([i]) == "\ufffd"]
    assert len(byte_ids) >= 2  # the emoji is split
    top = TokenLogprobs(-0.5, [byte_ids[0], byte_ids[1]], [-0.5, -4.0])
    delta = OutputDelta("", ids, 0, logprobs=[top] * len(ids))
    content = convert.ChoiceLogprobs(tiny_tokenizer).chat(delta).content
    assert bytes(b for entry in content for b in entry.bytes).decode() == "ok 🎉"
    assert content[0].top_logprobs[1].bytes == list(tiny_tokenizer.token_bytes(byte_ids[1]))
    completion = convert.ChoiceLogprobs(tiny_tokenizer).completion(delta)
    assert completion.top_logprobs[0] == {"\ufffd": -0.5}


def test_text_offsets_count_a_split_character_once(tiny_tokenizer):
    """Completions' text_offset: where each token starts in the choice's text. The byte
    tokens of a split character each read U+FFFD alone; they start where the character does
    and only the last one moves the offset on (one step each, and all in one delta)."""
    from services.router.detokenizer import IncrementalDetokenizer
    from services.router.output import OutputBuilder, SchedulerDelta
    from services.router.stop import StopMatcher

    text = "ok 🎉 done"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    top = TokenLogprobs(-0.5, [ids[0]], [-0.5])
    seen = []
    for chunks in ([[i] for i in ids], [ids]):
        builder = OutputBuilder(
            IncrementalDetokenizer.for_prompt(tiny_tokenizer, []), StopMatcher([], False), 0
        )
        logprobs = convert.ChoiceLogprobs(tiny_tokenizer)
        offsets, received = [], ""
        for n, chunk in enumerate(chunks):
            last = n == len(chunks) - 1
            out = builder.add(
                SchedulerDelta(
                    n, chunk, [top] * len(chunk), finish_reason="length" if last else None
                )
            )
            received += out.text
            offsets += logprobs.completion(out).text_offset
        assert received == text
        # ['o', 'k', ' \ufffd', '\ufffd', '\ufffd', ' ', 'do', 'ne']: [0, 1, 2, 2, 2, 4, 5, 7]
        pieces = [tiny_tokenizer.decode([i]) for i in ids]
        split = [o for p, o in zip(pieces, offsets, strict=True) if "\ufffd" in p]
        assert len(split) >= 2 and len(set(split)) == 1, (pieces, offsets)
        for piece, offset in zip(pieces, offsets, strict=True):
            assert text.startswith(piece.replace("\ufffd", ""), offset), (pieces, offsets)
        seen.append(offsets)
    assert seen[0] == seen[1]
