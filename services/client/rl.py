"""Serving inside a training loop: pause the engine, push new weights, resume.

    from services.client.rl import EngineControl

    with EngineControl("scheduler:50060", token=os.environ["CONVEYOR_INTERNAL_TOKEN"]) as engine:
        engine.init_weight_transfer("10.0.0.5")       # the trainer's address, as workers see it
        for step in range(num_steps):
            ...generate through the router, compute a loss, optimizer.step()...
            update = engine.push_weights(model.state_dict())   # pause, broadcast, resume
            print(update.weight_version, update.total_s)

This talks to the scheduler (admin calls: the internal token, or loopback on a stack without
one) and, for `push_weights`, to the stage workers over torch.distributed (gloo): the trainer
is rank 0 of a group it hosts at `master_addr:master_port`; it broadcasts every tensor by
its Hugging Face name and each stage keeps the ones it owns (services/common/weight_transfer.py).
The model must be the served one (same names and shapes); float32, bfloat16 or float16.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from services.common.proto.conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.redis_server import free_port
from services.common.security import ClientSecurity
from services.common.weight_transfer import broadcast_state_dict, join_group

MODES = {
    "wait": scheduler_pb2.PAUSE_MODE_WAIT,
    "keep": scheduler_pb2.PAUSE_MODE_KEEP,
    "abort": scheduler_pb2.PAUSE_MODE_ABORT,
}


@dataclass(slots=True)
class WeightUpdate:
    """What one update took, as the scheduler measured it (seconds), and the trainer's side."""

    weight_version: int
    num_tensors: int
    pause_s: float
    stage_s: float
    """Reading the files, or the whole broadcast (the stages receive while it runs)."""
    commit_s: float
    total_s: float
    broadcast_s: float = 0.0
    """Trainer side: sending every tensor (0 for a file update)."""
    num_bytes: int = 0


class EngineControl:
    """Admin client of one scheduler (one pipeline)."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        tls_ca: str | None = None,
        timeout_s: float = 600.0,
    ):
        self.security = (
            ClientSecurity.from_files(tls_ca, None, None, token)
            if tls_ca
            else ClientSecurity(token=token)
        )
        self._channel = self.security.sync_channel(address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._metadata = self.security.with_metadata(None)
        self.timeout_s = timeout_s
        self._group = None

    def __enter__(self) -> EngineControl:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    # -- pause --------------------------------------------------------------------------------
    def pause(self, mode: str = "keep") -> scheduler_pb2.PauseState:
        """Pauses (`wait`, `keep` or `abort`, see docs/training.md); returns once it holds."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: choose one of {sorted(MODES)}")
        request = scheduler_pb2.PauseRequest(mode=MODES[mode])
        return self._stub.Pause(request, timeout=self.timeout_s, metadata=self._metadata)

    def unpause(self) -> scheduler_pb2.PauseState:
        request = scheduler_pb2.UnpauseRequest()
        return self._stub.Unpause(request, timeout=self.timeout_s, metadata=self._metadata)

    # -- weights ------------------------------------------------------------------------------
    def update_from_files(
        self, path: str, layers: list[int] | None = None, recompute_kept: bool = False
    ) -> WeightUpdate:
        """Every stage reloads its tensors of `layers` (all: None) from the model directory
        `path` (safetensors, as the workers see it)."""
        request = scheduler_pb2.UpdateWeightsRequest(
            path=path, layers=layers or [], recompute_kept=recompute_kept
        )
        *_, done = self._stub.UpdateWeights(
            request, timeout=self.timeout_s, metadata=self._metadata
        )
        return _update(done)

    def init_weight_transfer(
        self, master_addr: str = "127.0.0.1", master_port: int | None = None, timeout_s=300.0
    ) -> int:
        """Forms the group with every stage (this process is rank 0 and hosts its rendezvous
        on `master_addr:master_port`, any free port when None); returns its size."""
        port = master_port or free_port()
        request = scheduler_pb2.InitWeightTransferRequest(
            master_addr=master_addr, master_port=port, timeout_s=timeout_s
        )
        reply = self._stub.InitWeightTransfer(request, timeout=60, metadata=self._metadata)
        self._group = join_group(master_addr, port, 0, reply.world_size, timeout_s)
        return reply.world_size

    def push_weights(
        self, state_dict: dict[str, torch.Tensor], recompute_kept: bool = False
    ) -> WeightUpdate:
        """Pauses stepping, broadcasts `state_dict` (Hugging Face names), commits on every
        stage, resumes: one UpdateWeights call. Raises `grpc.RpcError` (nothing changed on
        any stage) when a stage refuses or fails."""
        if self._group is None:
            raise RuntimeError("call init_weight_transfer() first")
        request = scheduler_pb2.UpdateWeightsRequest(recompute_kept=recompute_kept)
        stream = self._stub.UpdateWeights(request, timeout=self.timeout_s, metadata=self._metadata)
        first = next(stream)  # RECEIVING: every stage is in the broadcast (or an error)
        if first.phase != scheduler_pb2.UpdateWeightsProgress.PHASE_RECEIVING:
            raise RuntimeError(f"the scheduler answered {first} before the broadcast")
        t0 = time.perf_counter()
        num_bytes = broadcast_state_dict(self._group, _distinct(state_dict))
        broadcast_s = time.perf_counter() - t0
        update = _update(next(stream))
        update.broadcast_s, update.num_bytes = broadcast_s, num_bytes
        return update

    def stats(self) -> scheduler_pb2.SchedulerStats:
        return self._stub.GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=30, metadata=self._metadata
        )


def _distinct(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` without the tensors that share storage with an earlier one (a tied
    lm_head is the embedding: the stages take the embedding for it)."""
    seen, distinct = set(), {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            distinct[name] = tensor
    return distinct


def _update(msg: scheduler_pb2.UpdateWeightsProgress) -> WeightUpdate:
    return WeightUpdate(
        msg.weight_version, msg.num_tensors, msg.pause_s, msg.stage_s, msg.commit_s, msg.total_s
    )


__all__ = ["EngineControl", "WeightUpdate"]
