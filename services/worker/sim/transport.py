"""`SimTransport`: the real stage transport carrying small stand-ins, the real bytes timed.

A simulated stage sends the runner's wire tensor [T, 4] (see runner.py) instead of the
hidden states [T, H] over the real link (gloo in a worker, the in-memory link in tests),
stamped with its send time. The receiver holds it until

    arrival = send time + link latency + T x H x dtype bytes / link bandwidth

so the stage waits as long as the real activations would have taken (never less than the
real small message took: a slow real link shows). Sampled tokens from the last stage to
stage 0 travel as themselves, with the send time appended. Sends stay asynchronous: a
sender never waits for its bytes to arrive, as with NCCL or gloo sends.

Send times are wall-clock (`time.time`): exact between processes of one machine; across
machines, the clock offset between them adds to (or hides) the modeled transfer.
"""

from __future__ import annotations

import time

import torch

from services.worker.sim.clock import Sleeper
from services.worker.sim.runner import COL_SENT_AT, WIRE_DTYPE, WIRE_WIDTH
from services.worker.sim.timing import StageTimingModel
from services.worker.transport import Link, Transport

_MAX_WAIT_S = 10.0
"""A send time further ahead than this is a clock problem, not a transfer: not waited for."""


class SimLink:
    """A `Link` over another link: wire tensors for hidden states, arrivals delayed."""

    def __init__(self, inner: Link, timing: StageTimingModel, sleeper: Sleeper) -> None:
        self.inner, self.timing, self.sleeper = inner, timing, sleeper

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """hidden: the wire tensor [T, 4] of the runner."""
        hidden[:, COL_SENT_AT] = time.time()
        self.inner.send_hidden(hidden)

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """The wire tensor [T, 4], once the real [T, hidden] activations would have arrived."""
        wire = self.inner.recv_hidden(num_tokens, WIRE_WIDTH, WIRE_DTYPE)
        sent_at = float(wire[0, COL_SENT_AT]) if num_tokens else time.time()
        self._wait_until(sent_at + self.timing.transfer_s(num_tokens))
        return wire

    def expect_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> None:
        self.inner.expect_hidden(num_tokens, WIRE_WIDTH, WIRE_DTYPE)

    def expect_tokens(self, num_tokens: int) -> None:
        self.inner.expect_tokens(num_tokens + 1)

    def send_tokens(self, token_ids: torch.Tensor) -> None:
        """token_ids: [N] int64; goes out as [N + 1] with the send time (ns) last."""
        stamp = torch.tensor([time.time_ns()], dtype=torch.int64)
        self.inner.send_tokens(torch.cat([token_ids.to(torch.int64), stamp]))

    def recv_tokens(self, num_tokens: int) -> torch.Tensor:
        """[N] int64 from the last stage, once they would have arrived."""
        message = self.inner.recv_tokens(num_tokens + 1)
        sent_at = int(message[-1]) / 1e9
        self._wait_until(sent_at + self.timing.token_transfer_s(num_tokens))
        return message[:-1]

    def _wait_until(self, wall_time: float) -> None:
        self.sleeper.sleep_for(min(wall_time - time.time(), _MAX_WAIT_S))


class SimTransport:
    """A `Transport` whose sessions are `SimLink`s over `inner`'s links."""

    def __init__(self, inner: Transport, timing: StageTimingModel) -> None:
        self.inner, self.timing = inner, timing
        self.stage, self.num_stages = inner.stage, inner.num_stages
        self.sleeper = Sleeper()

    @property
    def is_first(self) -> bool:
        return self.inner.is_first

    @property
    def is_last(self) -> bool:
        return self.inner.is_last

    def connect(self, epoch: int = 0) -> SimLink:
        return SimLink(self.inner.connect(epoch), self.timing, self.sleeper)
