"""One simulated stage as `conveyor worker --device sim` serves it: runner + transport."""

from __future__ import annotations

import torch

from services.worker.config import WorkerConfig
from services.worker.sim.runner import SimStageRunner
from services.worker.sim.transport import SimTransport
from services.worker.transport import StageTransport


def build_sim_stage(config: WorkerConfig) -> tuple[SimStageRunner, SimTransport]:
    """The runner of `config`'s stage and its transport: the real gloo links (on CPU)
    carrying the sim's small tensors."""
    runner = SimStageRunner.from_config(config)
    inner = StageTransport(
        config.stage_index,
        config.num_stages,
        config.dist_addr,
        torch.device("cpu"),
        bind_host=config.host,
        secret=config.internal_token,
    )
    return runner, SimTransport(inner, runner.timing_model)
