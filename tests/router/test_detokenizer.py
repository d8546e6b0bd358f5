"""Streaming detokenization never shows a broken character and adds up to the full text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.models.tiny import make_tiny_model
from services.router.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
)
from services.router.tokenizer import Tokenizer

MULTIBYTE_TEXT = "Grüße 日本語 and 你好 🙂👍🏽🚀👨‍👩‍👧 done."


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    return Tokenizer.from_dir(make_tiny_model(tmp_path_factory.mktemp("detok") / "m", num_layers=1))


@pytest.fixture(params=["smollm2", "tiny"])
def tok(request, tiny_tok):
    if request.param == "tiny":
        return tiny_tok
    return Tokenizer.from_dir(request.getfixturevalue("smollm2_dir"))


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [detok.flush()]


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_detokenizer_never_emits_partial_characters(tok, chunk):
    ids = tok.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    # The text really splits characters across tokens (byte tokens decode to U+FFFD alone).
    assert any(REPLACEMENT_CHAR in tok.decode([i]) for i in ids)
    deltas = _stream(IncrementalDetokenizer(tok), ids, chunk)
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE_TEXT


def test_detokenizer_with_prompt_context_emits_only_generated_text(tok):
    prompt_ids = tok.encode("A prompt that ends with 日", add_special_tokens=False)
    generated = tok.encode(" 本語 🙂 ok", add_special_tokens=False)
    detok = IncrementalDetokenizer.for_prompt(tok, prompt_ids)
    assert "".join(_stream(detok, generated)) == tok.decode(generated)


def test_detokenizer_skips_special_tokens(tok):
    eos = tok.eos_token_id
    ids = tok.encode("bye 👋", add_special_tokens=False) + [eos]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    deltas = _stream(detok, ids)
    assert "".join(deltas) == "bye 👋"
    kept = "".join(_stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids))
    assert kept == "bye 👋" + tok.id_to_token(eos)


def test_detokenizer_holds_back_incomplete_character_until_flush(tiny_tok):
    ids = tiny_tok.encode("x🚀", add_special_tokens=False)
    assert len(ids) >= 3  # the rocket is spelled with several byte tokens
    detok = IncrementalDetokenizer(tiny_tok)
    streamed = "".join(detok.step([i]) for i in ids[:-1])
    assert streamed == "x"  # the rocket's bytes are waiting
    assert detok.flush() == REPLACEMENT_CHAR  # the stream ended mid-character


def test_detokenizer_state_stays_small_on_long_outputs(tiny_tok):
    ids = tiny_tok.encode("the quick brown fox 🙂 " * 200, add_special_tokens=False)
    detok = IncrementalDetokenizer(tiny_tok)
    text = "".join(_stream(detok, ids))
    assert text == tiny_tok.decode(ids)
    assert len(detok.ids) < 16 and detok.num_generated == len(ids)


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(
        alphabet=st.characters(exclude_categories=("Cs",), exclude_characters=REPLACEMENT_CHAR),
        max_size=40,
    ),
    chunk=st.integers(1, 4),
)
def test_detokenizer_concatenation_equals_decode_for_any_text(tiny_tok, text, chunk):
    ids = tiny_tok.encode(text, add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tiny_tok, skip_special_tokens=False), ids, chunk)
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert "".join(deltas) == text


def test_detokenizer_resumed_at_any_offset_adds_up_to_the_text(tok):
    """Resume: the text a client received before a break (steps, no flush) plus the text a
    new router streams from that offset on is the whole text, at every split, even one
    inside a character (its bytes are held back, then come out whole after the resume)."""
    ids = tok.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    for offset in range(len(ids) + 1):
        first = IncrementalDetokenizer(tok)
        before = [first.step([i]) for i in ids[:offset]]
        resumed = IncrementalDetokenizer.for_resume(tok, ids[:offset])
        after = _stream(resumed, ids[offset:])
        assert all(REPLACEMENT_CHAR not in delta for delta in before + after), offset
        assert "".join(before + after) == MULTIBYTE_TEXT, offset


def test_detokenizer_lets_a_run_of_invalid_bytes_go_as_replacement_characters(tok):
    """Continuation bytes with no start byte never complete a character: they are not held
    back for good (each step decoded the whole held run again: quadratic time on the
    router's loop for a long run), and the stream still adds up to the text."""
    byte_token = next(
        i
        for i in range(tok.vocab_size)
        if tok.decode([i]) == REPLACEMENT_CHAR and tok.decode([i, i]) == REPLACEMENT_CHAR * 2
    )
    ids = [byte_token] * 100 + tok.encode(" ok", add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tok), ids)
    assert all(deltas[1:100]), "held back until the run ends"
    assert "".join(deltas) == tok.decode(ids)


def test_token_bytes_rebuild_text_split_across_tokens(tok):
    """OpenAI's logprobs `bytes`: joined, the tokens' bytes are the text (they were each
    token's lossy text, U+FFFD for every byte token)."""
    ids = tok.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == MULTIBYTE_TEXT
    assert tok.token_bytes(tok.eos_token_id) == tok.decode([tok.eos_token_id]).encode()
