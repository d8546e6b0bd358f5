"""`conveyor worker --draft`: the draft model for speculative decoding as a gRPC service
(thin edge over `Drafter`, services/worker/draft.py)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.common.errors import PipelineUnavailable
from services.common.proto.conveyor.v1 import draft_pb2, draft_pb2_grpc, worker_pb2
from services.worker.config import WorkerConfig
from services.worker.draft import Drafter, DraftSequence
from services.worker.runner import StageRunner
from services.worker.server import internal_server

logger = logging.getLogger(__name__)

_SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name


class DraftWorkerServicer(draft_pb2_grpc.DraftWorkerServicer):
    """Registered before the server starts; `drafter` is set once the model is loaded, and
    until then Describe says not ready and Propose answers UNAVAILABLE."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.drafter: Drafter | None = None
        self.eos_token_ids: list[int] = []
        self._lock = asyncio.Lock()
        self.compute = ThreadPoolExecutor(1, thread_name_prefix="draft-compute")
        """The one thread that loads and runs the draft model: one OpenMP team in the
        process, not one per pool thread (services/worker/threads.py)."""

    async def Describe(self, request, context):
        drafter = self.drafter
        if drafter is None:
            return worker_pb2.DescribeResponse(num_stages=1, model_name=self.model_name)
        kv = drafter.runner.kv_cache
        return worker_pb2.DescribeResponse(
            num_stages=1,
            num_layers=drafter.runner.model.stage.num_layers,
            num_kv_blocks=kv.num_blocks,
            block_size=kv.block_size,
            ready=True,
            model_name=self.model_name,
            max_model_len=drafter.max_model_len,
            vocab_size=drafter.vocab_size,
            eos_token_ids=self.eos_token_ids,
            device=drafter.runner.device_kind,
        )

    async def Propose(self, request, context):
        if self.drafter is None:
            raise PipelineUnavailable("the draft model is still loading: retry in a few seconds")
        sequences = [
            DraftSequence(s.request_id, s.start, list(s.token_ids), s.num_tokens)
            for s in request.sequences
        ]
        async with self._lock:  # one batch at a time on the model
            out = await asyncio.get_running_loop().run_in_executor(
                self.compute, self.drafter.propose, sequences, list(request.finished_request_ids)
            )
        return draft_pb2.ProposeResponse(
            proposals=[
                draft_pb2.DraftProposal(request_id=request_id, token_ids=token_ids)
                for request_id, token_ids in out.proposals.items()
            ],
            unknown_request_ids=out.unknown_request_ids,
        )


async def serve(config: WorkerConfig) -> None:
    """Loads the draft model, serves it until SIGTERM/SIGINT, then drains gracefully."""
    server = internal_server("draft worker", _SERVICE, config)
    servicer = DraftWorkerServicer(Path(config.model_dir).name)
    server.add(draft_pb2_grpc.add_DraftWorkerServicer_to_server, servicer)
    await server.start()
    logger.info("draft worker: loading %s", config.model_dir)
    loop = asyncio.get_running_loop()
    try:
        runner = await loop.run_in_executor(servicer.compute, StageRunner.from_config, config)
    except BaseException:  # stopped while the loop runs, as the stage worker's (server.py)
        await server.stop(grace_s=0)
        raise
    max_model_len = config.max_model_len or runner.model.config.max_position_embeddings
    servicer.eos_token_ids = list(runner.model.config.eos_token_ids)
    servicer.drafter = Drafter(runner, max_model_len)
    await server.set_serving(True)
    logger.info(
        "draft worker serving on port %d: %d layers, %d KV blocks of %d tokens",
        config.port,
        runner.model.stage.num_layers,
        runner.kv_cache.num_blocks,
        runner.kv_cache.block_size,
    )
    await server.wait_for_stop()
    await server.stop(grace_s=5)
