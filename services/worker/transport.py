"""Stage-to-stage transport over `torch.distributed` point-to-point (gloo on CPU, NCCL on CUDA).

One process group per pipeline session over every rank of every stage (rank = stage x T +
tp rank), and one more per stage for its tensor-parallel collectives (docs/tensor-parallel.md).
Messages carry no header: every rank receives the same step plan, so a receiver knows each
message's shape before it arrives. With T ranks per stage, rank r of a stage talks to rank r
of the next (each holds the whole, all-reduced hidden states), so no process funnels them:

    stage 0 ──hidden [T, H]──▶ stage 1 ──hidden──▶ ... ──▶ stage P-1
       ▲                                                      │
       └──────────── sampled tokens [N] (async mode) ─────────┘

Each session builds its own process-group object and `PipelineLink` (no global default
group), so a session whose peer died can be abandoned, and a fresh one formed with the
restarted stage, while a thread of the old one may still sit in a wait (that wait ends when
the peer's socket closes or after `op_timeout_s`). Sends are kept and checked lazily: a stage
never blocks on a slow receiver.

The rendezvous (a `TCPStore` hosted by stage 0) listens on the --dist-addr host only (all
interfaces only when that is a wildcard), and gloo's own sockets on the worker's --host when it
is a specific address. With an internal token, each session's keys live under a namespace
derived from it and every value is signed with it (`SignedStore`): a process that reaches the
store without the token cannot plant an address for a stage. It can still read the keys, and
the activations themselves travel unauthenticated and unencrypted (docs/security.md).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import socket
import threading
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

    `PipelineLink` (torch.distributed) is the one every worker uses; anything with these
    methods can stand in for it, e.g. the in-memory link of tests/pipeline/utils.py that runs
    every stage in one process. Receivers know each message's shape from the step plan, and
    may post a receive before they wait for it (`expect_*`): gloo sends a message's bytes
    only once its receive is posted, so a receive posted late costs a round trip through the
    sender's network thread, on a core the sender's compute holds.
    """

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """hidden: [T, H] to the next stage."""

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, H] from the previous stage."""

    def send_tokens(self, token_ids: torch.Tensor) -> None:
        """token_ids: [N] int64, from the last stage to stage 0 (async mode)."""

    def recv_tokens(self, num_tokens: int) -> torch.Tensor:
        """[N] int64 from the last stage (stage 0, async mode)."""

    def expect_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> None:
        """Posts the receive of a later `recv_hidden`'s message now (receives are taken in
        the order they were posted): its bytes can then land while this stage computes."""

    def expect_tokens(self, num_tokens: int) -> None:
        """Posts the receive of a later `recv_tokens`'s message now, likewise."""


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


class SignedStore(dist.Store):
    """A rendezvous store whose values carry an HMAC of the internal token: a value written by
    anyone without the token fails `get` (the session does not form) instead of pointing a
    stage at a stranger's address."""

    def __init__(self, inner: dist.Store, secret: bytes):
        super().__init__()
        self._inner, self._secret = inner, secret

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, self._mac(key, value) + value)

    def get(self, key: str) -> bytes:
        blob = bytes(self._inner.get(key))
        mac, value = blob[:32], blob[32:]
        if not hmac.compare_digest(mac, self._mac(key, value)):
            raise RuntimeError(
                f"rendezvous key {key!r} holds a value not signed with this pipeline's internal "
                "token: another process wrote it (or the stages were given different tokens)"
            )
        return value

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def wait(self, keys, timeout=None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)


def session_prefix(epoch: int, secret: str | None) -> str:
    """The rendezvous keys' namespace of one session: derived from the internal token when
    there is one, so that a process without it cannot compute the next session's keys."""
    if secret is None:
        return f"pipeline/{epoch}"
    digest = hmac.new(secret.encode(), str(epoch).encode(), hashlib.sha256).hexdigest()
    return f"pipeline/{digest[:32]}"


def listen_socket(host: str, port: int) -> socket.socket | None:
    """A listening socket on `host` for the store to serve on; None for a wildcard host (or
    one that does not resolve yet): then the store listens on every interface."""
    if host in ("", "0.0.0.0", "::", "*"):
        return None
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        logger.warning(
            "cannot resolve %s (%s): the rendezvous listens on every interface", host, exc
        )
        return None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(128)
    return sock


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
        bind_host: str | None = None,
        secret: str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        """
        Args:
            tp_rank, tp_size: this worker's tensor-parallel rank and the ranks per stage.
            bind_host: the address gloo's sockets listen on (the worker's --host when it is
                a specific address); None: the one this machine's hostname resolves to.
            secret: the internal token; None: plain keys and values (docs/security.md).
        """
        self.stage = stage
        self.num_stages = num_stages
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = device
        self._dist_addr = dist_addr
        self._rendezvous_timeout = datetime.timedelta(seconds=rendezvous_timeout_s)
        self._op_timeout = datetime.timedelta(seconds=op_timeout_s)
        self._master_store: dist.TCPStore | None = None
        self._master_lock = threading.Lock()
        self._listener: socket.socket | None = None  # kept open: the store serves on it
        self._bind_host = listen_socket_host(bind_host) if bind_host else None
        self._secret = secret

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def num_ranks(self) -> int:
        return self.num_stages * self.tp_size

    @property
    def global_rank(self) -> int:
        return self.stage * self.tp_size + self.tp_rank

    def connect(self, epoch: int = 0) -> PipelineLink:
        """Forms this session's group with every stage; blocks until all have joined.

        `epoch` (chosen by the scheduler per session) prefixes the rendezvous keys, so a
        pipeline whose stage restarted forms a fresh group on the same store (served by
        stage 0 for the life of its process). Every stage, stage 0 too, talks to it through
        a connection of the session's own: a TCPStore client runs one operation at a time,
        so an ended session's thread still waiting there for a stage that died mid-join
        would otherwise hold the next session's rendezvous up until its timeout.
        """
        if self.num_ranks == 1:
            return PipelineLink(self.stage, self.num_stages, self.device, None)
        logger.info(
            "stage %d/%d tp rank %d/%d joining the pipeline at %s (epoch %d)",
            self.stage,
            self.num_stages,
            self.tp_rank,
            self.tp_size,
            self._dist_addr,
            epoch,
        )
        host, port = parse_addr(self._dist_addr, "--dist-addr")
        with self._master_lock:  # an ended session's thread may still be joining
            if self.global_rank == 0 and self._master_store is None:
                self._listener = listen_socket(host, port)
                self._master_store = dist.TCPStore(
                    host,
                    port,
                    self.num_ranks,
                    is_master=True,
                    timeout=self._rendezvous_timeout,
                    wait_for_workers=False,
                    master_listen_fd=self._listener.fileno() if self._listener else None,
                )
        store = dist.TCPStore(
            host, port, self.num_ranks, is_master=False, timeout=self._rendezvous_timeout
        )
        prefix = dist.PrefixStore(session_prefix(epoch, self._secret), store)
        if self._secret is not None:
            prefix = SignedStore(prefix, self._secret.encode())
        group = self._group(prefix, self.global_rank, self.num_ranks)
        tp_group = None
        if self.tp_size > 1:  # the stage's own group: its all-reduces never wait on others
            tp_store = dist.PrefixStore(f"tp/{self.stage}", prefix)
            tp_group = self._group(tp_store, self.tp_rank, self.tp_size)
        # Every rank has come before this one says it joined: gloo's group meets in its
        # constructor, NCCL's only at its first transfer.
        prefix.set(f"met/{self.global_rank}", b"1")
        prefix.wait([f"met/{rank}" for rank in range(self.num_ranks)])
        return PipelineLink(
            self.stage,
            self.num_stages,
            self.device,
            group,
            self.tp_rank,
            self.tp_size,
            tp_group,
            store=prefix,
        )

    def _group(self, store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
        if self.device.type == "cuda":
            return dist.ProcessGroupNCCL(store, rank, size)
        if self._bind_host is not None:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self._bind_host)]
            options._timeout = self._op_timeout
            return dist.ProcessGroupGloo(store, rank, size, options)
        return dist.ProcessGroupGloo(store, rank, size, self._op_timeout)


def listen_socket_host(host: str) -> str | None:
    """`host` as gloo's bind address: None for a wildcard (gloo then takes the address this
    machine's hostname resolves to)."""
    host = host.strip("[]")
    return None if host in ("", "0.0.0.0", "::", "*") else host


class PipelineLink:
    """One session's point-to-point links: to the same tp rank of the next stage, and last
    stage → stage 0 (a `Link`); `tp_group` is the stage's own group (None with one rank)."""

    def __init__(
        self,
        stage: int,
        num_stages: int,
        device: torch.device,
        group,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group=None,
        store: dist.Store | None = None,
    ):
        """`store`: the session's rendezvous store, kept for as long as the link lives (NCCL
        reads it at the first transfer, and a store written in Python, `SignedStore`, loses
        its methods when nothing in Python holds it any more)."""
        self.stage, self.num_stages, self.device = stage, num_stages, device
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._group = group
        self.tp_group = tp_group
        self.store = store
        self._pending: deque = deque()
        self._posted: dict[int, deque] = {_TAG_HIDDEN: deque(), _TAG_TOKENS: deque()}
        """Per tag, receives posted ahead: (work, buffer), oldest first."""

    def _rank_of(self, stage: int) -> int:
        """The pipeline-group rank of this tp rank in `stage`."""
        return stage * self.tp_size + self.tp_rank

    # activations

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """hidden: [T, H] to the next stage."""
        self._send(hidden.contiguous(), self._rank_of(self.stage + 1), _TAG_HIDDEN)

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, H] from the previous stage."""
        return self._receive(_TAG_HIDDEN, (num_tokens, hidden_size), dtype)

    def expect_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> None:
        """Posts the receive of a later `recv_hidden`."""
        self._post_ahead(_TAG_HIDDEN, (num_tokens, hidden_size), dtype)

    # sampled tokens, last stage → stage 0 (async mode)

    def send_tokens(self, token_ids: torch.Tensor) -> None:
        """token_ids: [N] int64, from the last stage to stage 0."""
        tokens = token_ids.to(self.device, torch.int64).contiguous()
        self._send(tokens, self._rank_of(0), _TAG_TOKENS)

    def recv_tokens(self, num_tokens: int) -> torch.Tensor:
        """[N] int64 from the last stage."""
        return self._receive(_TAG_TOKENS, (num_tokens,), torch.int64)

    def expect_tokens(self, num_tokens: int) -> None:
        """Posts the receive of a later `recv_tokens`."""
        self._post_ahead(_TAG_TOKENS, (num_tokens,), torch.int64)

    def _post_ahead(self, tag: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Gloo only. NCCL runs a pair's sends and receives in one stream, in the order they
        were posted: a receive posted ahead would hold this stage's sends to that peer back
        until its message came (2 stages: stage 0's send of step s behind its receive of
        step s's tokens, which stage 1 sends once it has that send's activations)."""
        if self.device.type != "cuda":
            self._post(tag, shape, dtype)

    def _post(self, tag: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        src = self._rank_of(self.stage - 1 if tag == _TAG_HIDDEN else self.num_stages - 1)
        self._posted[tag].append((self._group.recv([buf], src, tag), buf))

    def _receive(self, tag: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The oldest receive posted for `tag` (one posted now if none), once complete."""
        posted = self._posted[tag]
        if not posted:
            self._post(tag, shape, dtype)
        work, buf = posted.popleft()
        if buf.shape != shape or buf.dtype != dtype:  # the engine posted out of plan order
            raise RuntimeError(
                f"stage {self.stage}: a receive posted for {list(buf.shape)} {buf.dtype} was "
                f"taken for {list(shape)} {dtype}"
            )
        work.wait()
        return buf

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        # The tensor stays referenced beside its handle until the send completed.
        self._pending.append((self._group.send([tensor], dst, tag), tensor))
        while len(self._pending) > _MAX_PENDING_SENDS:
            self._pending.popleft()[0].wait()  # raises if the send failed
