"""Stage-to-stage transport over `torch.distributed` point-to-point (gloo on CPU, NCCL on CUDA).

One process group per pipeline, rank = stage. Messages carry no header: every stage receives
the same step plan, so a receiver knows each message's shape before it arrives.

    stage 0 ──hidden [T, H]──▶ stage 1 ──hidden──▶ ... ──▶ stage P-1
       ▲                                                      │
       └──────────── sampled tokens [N] (async mode) ─────────┘

Sends are `isend`s whose handles are kept and waited for lazily, so a stage never blocks on
a slow receiver until too many sends are outstanding.
"""

from __future__ import annotations

import datetime
import logging
from collections import deque

import torch
import torch.distributed as dist

from services.common.errors import ConfigError

logger = logging.getLogger(__name__)

_TAG_HIDDEN = 1
_TAG_TOKENS = 2
_MAX_PENDING_SENDS = 8


def parse_addr(addr: str, name: str = "address") -> tuple[str, int]:
    """`HOST:PORT` → (host, port), with an error naming the flag."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{name}={addr!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class StageTransport:
    """Point-to-point links of one stage: to the next stage, and last stage ↔ stage 0."""

    def __init__(
        self,
        stage: int,
        num_stages: int,
        dist_addr: str,
        device: torch.device,
        timeout_s: float = 600.0,
    ):
        self.stage = stage
        self.num_stages = num_stages
        self.device = device
        self._dist_addr = dist_addr
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._pending: deque[dist.Work] = deque()
        self._store: dist.TCPStore | None = None
        self.is_connected = False

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def connect(self, epoch: int = 0) -> None:
        """Joins the pipeline's process group; blocks until every stage has joined.

        `epoch` (chosen by the scheduler per session) prefixes the rendezvous keys, so a
        pipeline whose stage restarted forms a fresh group on the same store. Stages other
        than 0 reconnect their store client each time, in case stage 0 was the one restarted.
        """
        if self.num_stages == 1:
            self.is_connected = True
            return
        host, port = parse_addr(self._dist_addr, "--dist-addr")
        if self._store is None or not self.is_first:
            self._store = dist.TCPStore(
                host, port, self.num_stages, is_master=self.is_first,
                timeout=self._timeout, wait_for_workers=False,
            )  # fmt: skip
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        prefix = dist.PrefixStore(f"pipeline/{epoch}", self._store)
        logger.info(
            "stage %d/%d joining %s group at %s (epoch %d)", self.stage, self.num_stages,
            backend, self._dist_addr, epoch,
        )  # fmt: skip
        dist.init_process_group(
            backend, store=prefix, rank=self.stage, world_size=self.num_stages,
            timeout=self._timeout,
        )  # fmt: skip
        self.is_connected = True

    def close(self) -> None:
        self._pending.clear()
        if self.is_connected and self.num_stages > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.is_connected = False

    # activations

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """hidden: [T, H] to the next stage."""
        self._isend(hidden.contiguous(), self.stage + 1, _TAG_HIDDEN)

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, H] from the previous stage."""
        buf = torch.empty(num_tokens, hidden_size, dtype=dtype, device=self.device)
        dist.recv(buf, self.stage - 1, tag=_TAG_HIDDEN)
        return buf

    # sampled tokens, last stage → stage 0 (async mode)

    def send_tokens(self, token_ids: torch.Tensor) -> None:
        """token_ids: [N] int64, from the last stage to stage 0."""
        self._isend(token_ids.to(self.device, torch.int64).contiguous(), 0, _TAG_TOKENS)

    def recv_tokens(self, num_tokens: int) -> torch.Tensor:
        """[N] int64 from the last stage."""
        buf = torch.empty(num_tokens, dtype=torch.int64, device=self.device)
        dist.recv(buf, self.num_stages - 1, tag=_TAG_TOKENS)
        return buf

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        # Keep the tensor alive with its handle until the send completed.
        self._pending.append((dist.isend(tensor, dst, tag=tag), tensor))
        while len(self._pending) > _MAX_PENDING_SENDS:
            self._pending.popleft()[0].wait()
        while self._pending and self._pending[0][0].is_completed():
            self._pending.popleft()

    def flush(self) -> None:
        """Waits for every outstanding send."""
        while self._pending:
            self._pending.popleft()[0].wait()
