"""Stop strings over streamed text (pure).

Text arrives in pieces that do not respect stop-string boundaries, so the matcher holds
back the longest tail of the text that could still become a stop string:

    emitted ........|held|  + new piece
    "Hello, wor"     "ld"     stop "ld!"  -> hold "ld" until the next piece decides

On a match, the output ends before the stop string (or after it with
include_stop_str_in_output) and nothing after it is ever emitted.

Text fed with `can_stop=False` (the first min_tokens tokens, as vLLM does) never stops the
request: a stop string counts only when it ends in text fed after, though it may start in
the text before (still held back, so the cut never removes text already emitted).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StopMatcher:
    """Per-request stop-string state; feed text with `feed()`, then `flush()` at the end."""

    stop: list[str]
    include_stop_str_in_output: bool = False
    is_stopped: bool = False
    matched: str | None = None
    _pending: str = field(default="")
    _num_protected: int = 0
    """Leading characters of `_pending` fed with can_stop=False: no match may end in them."""

    def feed(self, text: str, can_stop: bool = True) -> str:
        """Add generated text; return the text that is now safe to emit. With
        `can_stop=False` no stop string may end in `text` (min_tokens not reached)."""
        if self.is_stopped:
            return ""
        if not self.stop:
            return text
        buf = self._pending + text
        protected = len(buf) if not can_stop else self._num_protected
        match = _earliest_match(buf, self.stop, min_end=protected + 1)
        if match is not None:
            start, stop = match
            self.is_stopped, self.matched, self._pending = True, stop, ""
            return buf[: start + len(stop)] if self.include_stop_str_in_output else buf[:start]
        hold = _longest_partial_suffix(buf, self.stop)
        self._pending = buf[len(buf) - hold :]
        self._num_protected = max(0, protected - (len(buf) - hold))
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """The held-back text, released when generation ends without a match."""
        text, self._pending = self._pending, ""
        return "" if self.is_stopped else text


def _earliest_match(text: str, stops: list[str], min_end: int = 0) -> tuple[int, str] | None:
    """(index, stop string) of the match that starts first among those ending at or after
    `min_end` characters; the longer stop wins a tie."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, min_end - len(stop)))
        if index < 0:
            continue
        if best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1])):
            best = (index, stop)
    return best


def _longest_partial_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
