"""`WeightControl`: UpdateWeights and InitWeightTransfer across every stage of the pipeline.

An update, atomic per pipeline:

    pause      KEEP (ABORT stays ABORT): no new step is planned, the steps in flight finish,
               so no step ever runs on a mix of old and new weights
    stage      every stage reads (files) or receives (trainer) its own tensors into fresh
               modules beside the live ones; trainer: RECEIVING tells the caller to broadcast
    commit     only when every stage staged: each swaps them in; otherwise each drops them
    invalidate new prefix-cache epoch; running requests recomputed when asked
    resume     the pause state from before the call

The stages' side is services/worker/weight_updates.py; the protocol on the wire between the
trainer and the stages is services/common/weight_transfer.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from services.common.errors import (
    ConveyorError,
    InvalidRequest,
    ModelLoadError,
    PipelineUnavailable,
)
from services.common.proto.conveyor.v1 import worker_pb2
from services.scheduler.scheduler import PauseMode
from services.scheduler.service import SchedulerService

logger = logging.getLogger(__name__)

DEFAULT_TRANSFER_TIMEOUT_S = 300.0
_CALL_TIMEOUT_S = 3600.0
"""A stage call may take as long as reading a large checkpoint or a slow trainer."""


@dataclass(slots=True)
class UpdateProgress:
    """One UpdateWeights message: RECEIVING (trainer: broadcast now) or DONE."""

    is_done: bool
    weight_version: int
    num_tensors: int = 0
    pause_s: float = 0.0
    stage_s: float = 0.0
    commit_s: float = 0.0
    total_s: float = 0.0


class WeightControl:
    """Drives weight updates over the service's pipeline; one at a time."""

    def __init__(self, service: SchedulerService):
        self.service = service
        self._lock = asyncio.Lock()

    async def init_transfer(self, master_addr: str, master_port: int, timeout_s: float) -> int:
        """Has every stage join the trainer's group; returns its size (1 + stages)."""
        if not master_addr or not 0 < master_port < 65536:
            raise InvalidRequest(
                f"master_addr:master_port {master_addr!r}:{master_port} is not an address: give "
                "the host and port where the trainer hosts the group's rendezvous"
            )
        if not 0 <= timeout_s <= 86400:
            raise InvalidRequest(f"timeout_s={timeout_s} is out of range [0, 86400]")
        pipeline = self.service.pipeline
        world_size = 1 + len(pipeline.stubs)
        calls = [
            stub.InitWeightTransfer(
                worker_pb2.StageTransferRequest(
                    master_addr=master_addr,
                    master_port=master_port,
                    rank=1 + stage,
                    world_size=world_size,
                    timeout_s=timeout_s or DEFAULT_TRANSFER_TIMEOUT_S,
                ),
                timeout=30,
                metadata=pipeline.metadata,
            )
            for stage, stub in enumerate(pipeline.stubs)
        ]
        await _gather_stages(calls)
        logger.info("stages joining the trainer's group at %s:%d", master_addr, master_port)
        return world_size

    async def update(
        self, path: str, layer_ids: list[int], recompute_kept: bool, version: int
    ) -> AsyncIterator[UpdateProgress]:
        """Runs one update (see the module's docstring); yields RECEIVING (trainer only)
        and DONE. Raises the stages' errors; then no stage changed its weights."""
        service = self.service
        if self._lock.locked():
            raise InvalidRequest("another weight update is running: wait for it to finish")
        async with self._lock:
            if service.scheduler is None or not service.is_pipeline_whole:
                raise PipelineUnavailable(
                    f"the pipeline is not whole ({service.not_serving_reason}): retry once it is"
                )
            if service.stages_disagree and layer_ids:
                raise InvalidRequest(
                    f"{service.not_serving_reason}: reload every layer (no `layers`)"
                )
            version = version or service.weight_version + 1
            if version <= service.weight_version:
                raise InvalidRequest(
                    f"weight_version={version} must be above the current {service.weight_version}"
                )
            t0 = time.perf_counter()
            previous = service.pause_mode
            # WAIT still steps running requests: freeze them too while the weights change.
            await service.pause(PauseMode.ABORT if previous is PauseMode.ABORT else PauseMode.KEEP)
            try:
                t_paused = time.perf_counter()
                stream = self._stage(path, layer_ids, version)
                num_tensors = None
                async for num_tensors in stream:
                    if num_tensors is None:  # every stage is in the trainer's broadcast
                        yield UpdateProgress(False, version)
                t_staged = time.perf_counter()
                await self._commit(version)
                service.weights_changed(version, recompute_kept)
                t_done = time.perf_counter()
            finally:
                service.restore_pause(previous)
            logger.info(
                "weights version %d from %s: %d tensors in %.2f s (staging %.2f s)",
                version,
                path or "the trainer",
                num_tensors,
                t_done - t0,
                t_staged - t_paused,
            )
            yield UpdateProgress(
                True,
                version,
                num_tensors,
                pause_s=t_paused - t0,
                stage_s=t_staged - t_paused,
                commit_s=t_done - t_staged,
                total_s=t_done - t0,
            )

    async def _stage(self, path: str, layer_ids: list[int], version: int):
        """Yields None once every stage accepted (trainer: in the broadcast), then the total of
        tensors staged. On any failure every stage drops what it staged."""
        pipeline = self.service.pipeline
        request = worker_pb2.StageWeightsRequest(
            path=path, layers=layer_ids, weight_version=version
        )
        calls = [
            stub.StageWeights(request, timeout=_CALL_TIMEOUT_S, metadata=pipeline.metadata)
            for stub in pipeline.stubs
        ]
        try:
            await _gather_stages([call.read() for call in calls])
            if not path:
                yield None
            replies = await _gather_stages([call.read() for call in calls])
        except BaseException:
            for call in calls:
                call.cancel()
            await self._discard()
            raise
        yield sum(r.num_tensors for r in replies)

    async def _commit(self, version: int) -> None:
        pipeline = self.service.pipeline
        request = worker_pb2.CommitWeightsRequest(weight_version=version)
        calls = [
            stub.CommitWeights(request, timeout=60, metadata=pipeline.metadata)
            for stub in pipeline.stubs
        ]
        try:
            await _gather_stages(calls)
        except ConveyorError as exc:
            # A swap is a pointer change: only a stage that died fails it. The others may have
            # swapped already: step nothing until an update makes them agree again.
            reason = f"a stage failed to commit weights version {version}: {exc}"
            self.service.stages_diverged(reason)
            raise

    async def _discard(self) -> None:
        pipeline = self.service.pipeline
        request = worker_pb2.CommitWeightsRequest(discard=True)
        results = await asyncio.gather(
            *[
                s.CommitWeights(request, timeout=30, metadata=pipeline.metadata)
                for s in pipeline.stubs
            ],
            return_exceptions=True,
        )
        for stage, result in enumerate(results):
            if isinstance(result, Exception):
                logger.warning("stage %d could not drop its staged weights: %s", stage, result)


async def _gather_stages(calls) -> list:
    """Awaits one call per stage; the first stage's error as the domain error it maps to."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for stage, result in enumerate(results):
        if isinstance(result, grpc.aio.AioRpcError):
            raise _stage_error(stage, result)
        if isinstance(result, BaseException):
            raise result
        if result is grpc.aio.EOF:
            raise PipelineUnavailable(f"stage {stage} ended the weight update early")
    return results


def _stage_error(stage: int, exc: grpc.aio.AioRpcError) -> ConveyorError:
    message = f"stage {stage}: {exc.details()}"
    code = exc.code()
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(message)
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return ModelLoadError(message)
    return PipelineUnavailable(f"{message} ({code.name})")
