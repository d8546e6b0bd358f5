"""Stage-to-stage transport over `torch.distributed` point-to-point (gloo on CPU, NCCL on CUDA).

One process group per pipeline session, rank = stage. Messages carry no header: every stage
receives the same step plan, so a receiver knows each message's shape before it arrives.

    stage 0 ──hidden [T, H]──▶ stage 1 ──hidden──▶ ... ──▶ stage P-1
       ▲                                                      │
       └──────────── sampled tokens [N] (async mode) ─────────┘

Each session builds its own process-group object and `PipelineLink` (no global default
group), so a session whose peer died can be abandoned, and a fresh one formed with the
restarted stage, while a thread of the old one may still sit in a wait (that wait ends when
the peer's socket closes or after `op_timeout_s`). Sends are kept and checked lazily: a stage
never blocks on a slow receiver.
"""

from __future__ import annotations

import datetime
import logging
from collections import deque
from typing import Protocol

import torch
import torch.distributed as dist

from services.common.config import parse_addr

logger = logging.getLogger(__name__)

_TAG_HIDDEN = 1
_TAG_TOKENS = 2
_MAX_PENDING_SENDS = 16


class Link(Protocol):
    """One session's messages between stages: all that `StageEngine` asks of a link.

    `PipelineLink` (torch.distributed) is the one every worker uses; anything with these four
    methods can stand in for it, e.g. the in-memory link of tests/pipeline/utils.py that runs
    every stage in one process. Receivers know each message's shape from the step plan.
    """

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """hidden: [T, H] to the next stage."""

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, H] from the previous stage."""

    def send_tokens(self, token_ids: torch.Tensor) -> None:
        """token_ids: [N] int64, from the last stage to stage 0 (async mode)."""

    def recv_tokens(self, num_tokens: int) -> torch.Tensor:
        """[N] int64 from the last stage (stage 0, async mode)."""


class Transport(Protocol):
    """A stage's place in the pipeline and how it joins each session: the seam between
    `StageEngine` and the wire. `StageTransport` is the production one."""

    stage: int
    num_stages: int

    @property
    def is_first(self) -> bool: ...

    @property
    def is_last(self) -> bool: ...

    def connect(self, epoch: int = 0) -> Link:
        """Joins the session `epoch` with every other stage (blocks until all have); the
        compute thread of `StageEngine` calls it once per session."""


class StageTransport:
    """Forms one `PipelineLink` per session for this stage (a `Transport`)."""

    def __init__(
        self,
        stage: int,
        num_stages: int,
        dist_addr: str,
        device: torch.device,
        rendezvous_timeout_s: float = 60.0,
        op_timeout_s: float = 120.0,
    ):
        self.stage = stage
        self.num_stages = num_stages
        self.device = device
        self._dist_addr = dist_addr
        self._rendezvous_timeout = datetime.timedelta(seconds=rendezvous_timeout_s)
        self._op_timeout = datetime.timedelta(seconds=op_timeout_s)
        self._master_store: dist.TCPStore | None = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def connect(self, epoch: int = 0) -> PipelineLink:
        """Forms this session's group with every stage; blocks until all have joined.

        `epoch` (chosen by the scheduler per session) prefixes the rendezvous keys, so a
        pipeline whose stage restarted forms a fresh group on the same store (hosted by
        stage 0 for the life of its process; other stages reconnect each session, in case
        stage 0 was the one restarted).
        """
        if self.num_stages == 1:
            return PipelineLink(self.stage, self.num_stages, self.device, None)
        host, port = parse_addr(self._dist_addr, "--dist-addr")
        if self.is_first:
            if self._master_store is None:
                self._master_store = dist.TCPStore(
                    host,
                    port,
                    self.num_stages,
                    is_master=True,
                    timeout=self._rendezvous_timeout,
                    wait_for_workers=False,
                )
            store = self._master_store
        else:
            store = dist.TCPStore(
                host, port, self.num_stages, is_master=False, timeout=self._rendezvous_timeout
            )
        prefix = dist.PrefixStore(f"pipeline/{epoch}", store)
        logger.info(
            "stage %d/%d joining the pipeline at %s (epoch %d)",
            self.stage,
            self.num_stages,
            self._dist_addr,
            epoch,
        )
        if self.device.type == "cuda":
            group = dist.ProcessGroupNCCL(prefix, self.stage, self.num_stages)
        else:
            group = dist.ProcessGroupGloo(prefix, self.stage, self.num_stages, self._op_timeout)
        return PipelineLink(self.stage, self.num_stages, self.device, group)


class PipelineLink:
    """One session's point-to-point links: to the next stage, and last stage → stage 0
    (a `Link`)."""

    def __init__(self, stage: int, num_stages: int, device: torch.device, group):
        self.stage, self.num_stages, self.device = stage, num_stages, device
        self._group = group
        self._pending: deque = deque()

    # activations

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """hidden: [T, H] to the next stage."""
        self._send(hidden.contiguous(), self.stage + 1, _TAG_HIDDEN)

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, H] from the previous stage."""
        buf = torch.empty(num_tokens, hidden_size, dtype=dtype, device=self.device)
        self._group.recv([buf], self.stage - 1, _TAG_HIDDEN).wait()
        return buf

    # sampled tokens, last stage → stage 0 (async mode)

    def send_tokens(self, token_ids: torch.Tensor) -> None:
        """token_ids: [N] int64, from the last stage to stage 0."""
        self._send(token_ids.to(self.device, torch.int64).contiguous(), 0, _TAG_TOKENS)

    def recv_tokens(self, num_tokens: int) -> torch.Tensor:
        """[N] int64 from the last stage."""
        buf = torch.empty(num_tokens, dtype=torch.int64, device=self.device)
        self._group.recv([buf], self.num_stages - 1, _TAG_TOKENS).wait()
        return buf

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        # The tensor stays referenced beside its handle until the send completed.
        self._pending.append((self._group.send([tensor], dst, tag), tensor))
        while len(self._pending) > _MAX_PENDING_SENDS:
            self._pending.popleft()[0].wait()  # raises if the send failed
