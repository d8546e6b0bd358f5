"""Deterministic "sampled" tokens of the simulated device.

The token at position p of a request is a hash of (the request's key, p), where the key is
its seed, else a hash of its prompt ids. It depends on nothing else (not the batch, the
step, the mode or the stage count), so sync and async runs, and reruns, give exactly the
same tokens, and a test can compute what every request must receive (`expected_tokens`).

Ids are drawn from the regular (non-special) tokens of the tokenizer the model directory
ships, below the model's vocab_size, so the router can detokenize every one. EOS comes out
only when the request does not ignore it, on one position in EOS_EVERY on average.
"""

from __future__ import annotations

import hashlib
import json
import logging
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from services.common.sampling import SamplingParams
from services.common.step import TokenLogprobs

logger = logging.getLogger(__name__)

EOS_EVERY = 1024
"""A request that does not ignore EOS gets it on 1 position in EOS_EVERY (a hash decides)."""
OTHER_LOGPROB = -30.0
"""The sim's distribution is a point mass on the sampled token: logprob 0 for it, this for
the runners-up reported as top tokens."""
_MASK = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 (wrapping): a bijection with good avalanche."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def request_key(sampling: SamplingParams, prompt_ids: Sequence[int]) -> int:
    """The seed a request's tokens derive from: its seed, else a hash of its prompt."""
    if sampling.seed is not None:
        return int(_mix(np.array([sampling.seed & _MASK], dtype=np.uint64))[0])
    digest = hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class TokenSource:
    """Picks the token of (request key, position) among `vocab_ids`."""

    def __init__(self, vocab_ids: Sequence[int], eos_token_ids: Sequence[int]) -> None:
        if not vocab_ids:
            raise ValueError("a TokenSource needs at least one regular token id")
        self.vocab_ids = list(vocab_ids)
        self.eos_token_ids = list(eos_token_ids)
        self._vocab = np.array(self.vocab_ids, dtype=np.int64)

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> TokenSource:
        """The regular ids of `model_dir`'s tokenizer.json below `vocab_size` (every id below
        it but EOS when there is no readable tokenizer.json)."""
        excluded = set(eos_token_ids)
        ids = _tokenizer_regular_ids(Path(model_dir) / "tokenizer.json")
        if ids is None:
            ids = range(vocab_size)
        return cls([i for i in sorted(ids) if i < vocab_size and i not in excluded], eos_token_ids)

    def tokens(
        self, keys: Sequence[int], positions: Sequence[int], ignore_eos: Sequence[bool]
    ) -> list[int]:
        """The token at `positions[i]` (its index in prompt + output) of request `keys[i]`,
        for a whole step at once."""
        h = _mix(np.array(keys, dtype=np.uint64) ^ _mix(np.array(positions, dtype=np.uint64)))
        ids = self._vocab[(h >> np.uint64(20)) % np.uint64(len(self._vocab))]
        if self.eos_token_ids and not all(ignore_eos):
            is_eos = (h % np.uint64(EOS_EVERY) == 0) & ~np.array(ignore_eos, dtype=bool)
            ids[is_eos] = self.eos_token_ids[0]
        return ids.tolist()

    def logprobs(self, token_id: int, num_top: int) -> TokenLogprobs:
        """Logprobs of a point mass on `token_id`, with `num_top` top tokens."""
        others = [i for i in self.vocab_ids[: num_top + 1] if i != token_id][: max(num_top - 1, 0)]
        top_ids = [token_id, *others][:num_top]
        return TokenLogprobs(0.0, top_ids, [0.0] + [OTHER_LOGPROB] * (len(top_ids) - 1))

    def expected_tokens(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, num_tokens: int
    ) -> list[int]:
        """The first `num_tokens` tokens the sim generates for a request (EOS not cut; none
        before min_tokens)."""
        key = request_key(sampling, prompt_ids)
        positions = range(len(prompt_ids), len(prompt_ids) + num_tokens)
        no_eos = [sampling.ignore_eos or k < sampling.min_tokens for k in range(num_tokens)]
        return self.tokens([key] * num_tokens, positions, no_eos)


def _tokenizer_regular_ids(path: Path) -> set[int] | None:
    """Ids of the vocabulary and the non-special added tokens of a tokenizer.json."""
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        vocab = raw["model"]["vocab"]
        ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
        for added in raw.get("added_tokens") or []:
            if added.get("special"):
                ids.discard(int(added["id"]))
            else:
                ids.add(int(added["id"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning("%s is not a tokenizer the sim can read (%s): using every id", path, exc)
        return None
    return ids
