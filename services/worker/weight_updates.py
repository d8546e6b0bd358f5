"""`WeightUpdates`: one stage's side of UpdateWeights and InitWeightTransfer.

Blocking methods (file reads, the trainer's broadcast, the swap): the servicer runs them on a
thread. One update at a time; the scheduler drives stage → commit on every stage, and
commits only when every stage staged (services/scheduler/weights.py).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from services.common.errors import InvalidRequest, PipelineUnavailable
from services.common.weight_transfer import join_group, receive_state_dict
from services.worker.engine import StageEngine
from services.worker.model.quant import checkpoint_reader
from services.worker.weights import (
    StagedWeights,
    TensorReader,
    commit,
    is_stage_model,
    owns,
    select_layers,
    select_received,
    stage_weights,
)

logger = logging.getLogger(__name__)


class WeightUpdates:
    """The stage's weight version, its staged update and its link to the trainer."""

    def __init__(self, engine: StageEngine):
        self.engine = engine
        self.version = 0
        """The version of the weights the stage serves (0: as loaded from --model)."""
        self._staged: StagedWeights | None = None
        self._lock = threading.Lock()
        self._join: concurrent.futures.Future | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights-join")

    @property
    def model(self):
        model = self.engine.runner.model
        if not is_stage_model(model):
            raise InvalidRequest("a simulated stage (--device sim) holds no weights to update")
        return model

    def init_transfer(
        self, master_addr: str, master_port: int, rank: int, world_size: int, timeout_s: float
    ) -> None:
        """Starts joining the trainer's group in the background (the trainer joins after)."""
        if not master_addr or not 0 < master_port < 65536:
            raise InvalidRequest(f"master address {master_addr}:{master_port} is not valid")
        if not 0 < rank < world_size:
            raise InvalidRequest(f"rank {rank} is not in 1..{world_size - 1}")
        self.model  # noqa: B018 - refuses a simulated stage now, not at the first update
        logger.info(
            "joining the trainer's group at %s:%d as rank %d", master_addr, master_port, rank
        )
        self._join = self._pool.submit(
            join_group, master_addr, master_port, rank, world_size, timeout_s
        )

    def plan_files(self, path: str, layer_ids: list[int], version: int) -> Callable[[], int]:
        """Checks a file update; returns what stages it: reads this stage's tensors of
        `layer_ids` (all: empty) from the directory `path`, returns how many."""
        if not Path(path).is_dir():
            raise InvalidRequest(f"{path} is not a directory on stage {self.engine.stage}'s host")
        model = self.model
        selection = select_layers(model, layer_ids)
        reader = checkpoint_reader(path)  # ModelLoadError now when the directory has none
        return lambda: self._stage(lambda: stage_weights(model, reader, selection, version))

    def plan_received(self, version: int) -> Callable[[], int]:
        """Checks a trainer update; returns what stages it: receives the broadcast, stages
        the tensors this stage owns, returns how many."""
        if self._join is None:
            raise InvalidRequest(
                f"stage {self.engine.stage} has no trainer group: call InitWeightTransfer first"
            )
        self.model  # noqa: B018 - refuses a simulated stage before the broadcast starts
        return functools.partial(self._stage_received, version)

    def _stage_received(self, version: int) -> int:
        model = self.model
        try:
            group = self._join.result()
            tensors = receive_state_dict(group, functools.partial(owns, model))
        except (RuntimeError, concurrent.futures.CancelledError) as exc:
            self._join = None  # a broken group is not used again
            raise PipelineUnavailable(
                f"stage {self.engine.stage}: the transfer from the trainer failed ({exc}): "
                "call InitWeightTransfer again"
            ) from exc
        selection = select_received(model, set(tensors))
        return self._stage(lambda: stage_weights(model, TensorReader(tensors), selection, version))

    def _stage(self, build) -> int:
        if not self._lock.acquire(blocking=False):
            raise InvalidRequest("another weight update is staging on this stage")
        try:
            self._staged = None
            self._staged = build()
            return self._staged.num_tensors
        finally:
            self._lock.release()

    def commit(self, version: int, discard: bool) -> int:
        """Swaps the staged weights in between two steps (or drops them); the version now."""
        staged, self._staged = self._staged, None
        if discard:
            return self.version
        if staged is None or staged.version != version:
            raise InvalidRequest(
                f"stage {self.engine.stage} has no staged weights of version {version}"
            )
        self.engine.between_steps(lambda: commit(self.model, staged))
        self.version = version
        logger.info(
            "stage %d serves weights version %d (%d tensors)",
            self.engine.stage,
            version,
            staged.num_tensors,
        )
        return version
