"""Stop strings match across arbitrary text pieces and never leak text past the match."""

from __future__ import annotations

import pytest

from services.router.stop import StopMatcher


def _run(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(p) for p in pieces)
    return out + matcher.flush()


@pytest.mark.parametrize("split", [1, 2, 3, 5])
def test_stop_matcher_finds_stop_split_over_pieces(split):
    text = "The answer is 42.\nUser: next question"
    pieces = [text[i : i + split] for i in range(0, len(text), split)]
    matcher = StopMatcher(["\nUser:"])
    assert _run(matcher, pieces) == "The answer is 42."
    assert matcher.is_stopped and matcher.matched == "\nUser:"


def test_stop_matcher_includes_stop_string_when_asked():
    matcher = StopMatcher(["END"], include_stop_str_in_output=True)
    assert _run(matcher, ["abc E", "N", "D tail"]) == "abc END"


def test_stop_matcher_holds_back_only_possible_prefixes():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("hello ST") == "hello "
    assert matcher.feed("ART") == "START"  # "ST" was not the start of STOP after all
    assert not matcher.is_stopped


def test_stop_matcher_releases_held_text_at_the_end():
    matcher = StopMatcher(["</s>"])
    assert matcher.feed("ends with </") == "ends with "
    assert matcher.flush() == "</"


def test_stop_matcher_earliest_match_wins():
    matcher = StopMatcher(["world", "lo w"])
    assert _run(matcher, ["hello world"]) == "hel"
    assert matcher.matched == "lo w"


def test_stop_matcher_emits_nothing_after_a_match():
    matcher = StopMatcher(["x"])
    assert matcher.feed("abxcd") == "ab"
    assert matcher.feed("more") == ""
    assert matcher.flush() == ""


def test_stop_matcher_without_stop_strings_passes_text_through():
    matcher = StopMatcher([])
    assert matcher.feed("anything") == "anything"


def test_stop_matcher_ignores_stops_ending_in_text_before_min_tokens():
    matcher = StopMatcher(["."])
    assert matcher.feed("One.", can_stop=False) == "One."
    assert matcher.feed(" Two.") == " Two"
    assert matcher.is_stopped


def test_stop_matcher_stop_may_start_in_protected_text_and_end_after():
    matcher = StopMatcher(["END", "EN"])
    # "EN" is complete but protected; it is held (it may still grow into "END"), and the
    # match that ends in the next piece cuts before it: nothing emitted is taken back.
    assert matcher.feed("abc EN", can_stop=False) == "abc "
    assert matcher.feed("D more") == ""
    assert matcher.is_stopped and matcher.matched == "END"
    protected = StopMatcher(["EN"])
    assert protected.feed("xEN", can_stop=False) == "xEN"
    assert protected.feed("EN") == ""
    assert protected.matched == "EN"
