"""Who a request belongs to, as the scheduler checks it (pure).

    key          "<principal>/<request_id>": the scheduler's id of a request. A client's ids
                 live in its principal's namespace, so equal ids of two principals never
                 meet; within one, a duplicate is ALREADY_EXISTS (and nothing else happens).
    owner_token  a secret the submitter chose (the router: random per Submit). Resume and
                 Abort act only when they present it, so a second Submit of a running id
                 (same principal) can neither read nor abort the first one.
    tombstones   an Abort that finds no request remembers (key, token) for `ttl_s`: when its
                 Submit arrives after all (the client cancelled while it was on its way), the
                 request is aborted on arrival and never runs.

A wrong token answers exactly like an unknown id, so ids cannot be probed.
"""

from __future__ import annotations

import hmac
import re
import time
from collections import OrderedDict
from collections.abc import Callable

from services.common.errors import InvalidRequest
from services.common.limits import check_request_id, clip

_PRINCIPAL = re.compile(r"\A[A-Za-z0-9._@-]{0,64}\Z")
_KEY = re.compile(r"\A(?:[A-Za-z0-9._@-]{1,64}/)?[A-Za-z0-9._:-]{1,128}\Z")
"""What `request_key` returns: the form a service behind the scheduler checks ids against."""


def request_key(principal: str, request_id: str) -> str:
    """The scheduler's id of `request_id` submitted by `principal` ("" = no namespace).

    Raises:
        InvalidRequest: a "/" in the id (it separates the namespace), or a principal that is
            not 0 to 64 of [A-Za-z0-9._@-].
    """
    if not _PRINCIPAL.match(principal):
        raise InvalidRequest(
            f"principal={principal[:80]!r} is not allowed: 0 to 64 letters, digits, '.', "
            "'_', '@' or '-'"
        )
    check_request_id(request_id)  # the client's id: letters, digits, ".", "_", ":", "-"
    return f"{principal}/{request_id}" if principal else request_id


def check_request_key(key: str) -> None:
    """Raises InvalidRequest unless `key` has the form of `request_key`'s result: what a
    draft worker checks the ids it is sent against (they reach its logs)."""
    if not _KEY.match(key):
        raise InvalidRequest(
            f"request id {clip(key)} is not a scheduler's request id: [principal/]id, a "
            "principal of 1 to 64 of [A-Za-z0-9._@-], an id of 1 to 128 of [A-Za-z0-9._:-]"
        )


def is_owner(expected: str | None, presented: str) -> bool:
    """Whether `presented` is the owner token a request was submitted with (constant time);
    a request stored before owner tokens existed (None) has the empty one."""
    return hmac.compare_digest((expected or "").encode(), presented.encode())


class Tombstones:
    """Aborts that arrived before their Submit: (key, owner token), each for `ttl_s`, at most
    `max_entries` (the oldest go first)."""

    def __init__(
        self,
        ttl_s: float = 300.0,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: str, owner_token: str) -> None:
        self._expire()
        self._entries.pop(key, None)
        self._entries[key] = (owner_token, self._clock() + self.ttl_s)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def take(self, key: str, owner_token: str) -> bool:
        """True (and forgotten) when an abort of exactly this submission came first."""
        self._expire()
        entry = self._entries.get(key)
        if entry is None or not is_owner(entry[0], owner_token):
            return False
        del self._entries[key]
        return True

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            key, (_, expires) = next(iter(self._entries.items()))
            if expires > now:
                return
            del self._entries[key]
