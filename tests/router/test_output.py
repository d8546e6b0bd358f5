"""Scheduler deltas become text without broken characters; stop strings cut across tokens."""

from __future__ import annotations

from services.common.sampling import SamplingParams
from services.router.output import OutputBuilder, SchedulerDelta
from services.router.request import PreparedRequest


def _builder(tokenizer, stop=(), include=False, min_tokens=0):
    req = PreparedRequest(
        request_id="r",
        prompt_ids=tokenizer.encode("Say:"),
        sampling=SamplingParams(max_tokens=64, min_tokens=min_tokens),
        stop=list(stop),
        include_stop_str_in_output=include,
    )
    return OutputBuilder.for_request(tokenizer, req)


def _feed(builder, ids, per_delta=1, finish="length"):
    outs = []
    for offset in range(0, len(ids), per_delta):
        chunk = ids[offset : offset + per_delta]
        last = offset + per_delta >= len(ids)
        out = builder.add(
            SchedulerDelta(offset=offset, token_ids=chunk, finish_reason=finish if last else None)
        )
        if out is not None:
            outs.append(out)
        if builder.is_finished:
            break
    return outs


def test_output_streams_multibyte_text_whole(tiny_tokenizer):
    text = " Grüße 日本語 🙂👍 ok"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    outs = _feed(_builder(tiny_tokenizer), ids)
    assert all("\ufffd" not in o.text for o in outs)
    assert "".join(o.text for o in outs) == text
    assert [i for o in outs for i in o.token_ids] == ids
    assert outs[-1].finish_reason == "length"
    assert outs[-1].usage.completion_tokens == len(ids)


def _stop_spanning_two_tokens(tokenizer, text: str) -> str:
    """A substring of `text` that starts inside one token and ends inside the next."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    for a, b in zip(pieces, pieces[1:], strict=False):
        if len(a) >= 2 and len(b) >= 2 and a.isascii() and b.isascii():
            return a[-2:] + b[:2]
    raise AssertionError("no two adjacent multi-character tokens")


def test_output_stop_string_across_tokens_ends_at_the_match(tiny_tokenizer):
    text = " The quick brown fox jumps over the lazy dog and runs away"
    stop = _stop_spanning_two_tokens(tiny_tokenizer, text)
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    for per_delta in (1, 2, 3):
        builder = _builder(tiny_tokenizer, stop=[stop])
        outs = _feed(builder, ids, per_delta)
        assert "".join(o.text for o in outs) == text[: text.index(stop)]
        assert outs[-1].finish_reason == "stop" and builder.is_stopped_by_string
        # Tokens stop at the one that completed the match, not at the end of the delta.
        num_ids = sum(len(o.token_ids) for o in outs)
        assert stop in tiny_tokenizer.decode(ids[:num_ids])
        assert stop not in tiny_tokenizer.decode(ids[: num_ids - 1])


def test_output_include_stop_str_in_output(tiny_tokenizer):
    text = " one two three four"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    outs = _feed(_builder(tiny_tokenizer, stop=["thr"], include=True), ids)
    assert "".join(o.text for o in outs) == " one two thr"


def test_output_held_back_text_is_released_at_finish(tiny_tokenizer):
    text = " the end <"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    outs = _feed(_builder(tiny_tokenizer, stop=["<stop>"]), ids, finish="stop")
    assert "".join(o.text for o in outs) == text
    assert outs[-1].finish_reason == "stop"


def test_output_carries_the_weight_version_of_each_delta(tiny_tokenizer):
    from services.router.generation import output_to_pb

    builder = _builder(tiny_tokenizer)
    ids = tiny_tokenizer.encode(" hello world")
    first = builder.add(SchedulerDelta(offset=0, token_ids=ids[:1], weight_version=2))
    last = builder.add(
        SchedulerDelta(offset=1, token_ids=ids[1:], finish_reason="length", weight_version=3)
    )
    assert (first.weight_version, last.weight_version) == (2, 3)
    assert output_to_pb("r", last).weight_version == 3


def test_output_stop_string_does_not_end_the_first_min_tokens(tiny_tokenizer):
    text = " one. two. three."
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    first_stop = next(i for i in range(len(ids)) if "." in tiny_tokenizer.decode(ids[: i + 1]))
    outs = _feed(_builder(tiny_tokenizer, stop=["."]), ids)
    assert "".join(o.text for o in outs) == " one"
    # The token that completes " one." is within min_tokens: only the next "." stops.
    outs = _feed(_builder(tiny_tokenizer, stop=["."], min_tokens=first_stop + 1), ids)
    assert "".join(o.text for o in outs) == " one. two"
    assert outs[-1].finish_reason == "stop"
    # Every token within min_tokens: the text passes whole.
    outs = _feed(_builder(tiny_tokenizer, stop=["."], min_tokens=len(ids)), ids)
    assert "".join(o.text for o in outs) == text and outs[-1].finish_reason == "length"
