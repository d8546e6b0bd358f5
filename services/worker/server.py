"""`conveyor worker`: one pipeline stage as a gRPC service (thin edge over StageEngine)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path
from typing import Protocol

from services.common.auth import Authenticator, OpenAccess
from services.common.errors import PipelineUnavailable
from services.common.pb import logprobs_to_pb, plan_from_pb
from services.common.proto.conveyor.v1 import worker_pb2, worker_pb2_grpc
from services.common.security import require_admin
from services.common.serving import GrpcServer
from services.common.step import SESSION_ACCEPTED
from services.worker.config import WorkerConfig
from services.worker.engine import StageEngine, StepOutcome
from services.worker.plan_record import PlanRecorder
from services.worker.runner import StageRunner
from services.worker.threads import run_in_own_thread
from services.worker.weight_updates import WeightUpdates

logger = logging.getLogger(__name__)

SESSION_WAIT_S = 5.0
"""How long a scheduler's Run waits for the previous session to wind down before the stage
refuses it as another scheduler's."""
_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["StageWorker"].full_name


def outcome_to_pb(outcome: StepOutcome, stage: int) -> worker_pb2.StepReport:
    report = worker_pb2.StepReport(step_id=outcome.step_id, stage=stage)
    if outcome.error:
        report.error = outcome.error
        return report
    if outcome.record is not None:
        report.compute_start_ns = outcome.record.start_ns
        report.compute_end_ns = outcome.record.end_ns
        report.wait_ns = outcome.record.wait_ns
    report.plan_wait_ns = outcome.plan_wait_ns
    result = outcome.result
    if result is not None:
        report.request_ids.extend(result.request_ids)
        report.token_ids.extend(result.token_ids)
        if result.logprobs:
            for index, lp in enumerate(result.logprobs):
                if lp is not None:
                    report.logprobs_index.append(index)
                    report.logprobs.append(logprobs_to_pb(lp))
    return report


class StepHooks(Protocol):
    """What a stage tells its observer (services/worker/observability.py: step metrics and
    spans)."""

    def on_plan(self, msg: worker_pb2.StepPlan) -> None: ...

    def on_outcome(self, outcome: StepOutcome) -> None: ...

    def reset(self) -> None: ...


class StageWorkerServicer(worker_pb2_grpc.StageWorkerServicer):
    """One Run session at a time; each session is one pipeline process group.

    Registered before the server starts (gRPC requires it); `engine` is set once the stage
    is loaded, and until then Describe says not ready and Run answers UNAVAILABLE.
    """

    def __init__(
        self, stage: int, num_stages: int, model_name: str, tp_rank: int = 0, tp_size: int = 1
    ):
        self.stage, self.num_stages = stage, num_stages
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.model_name = model_name
        self.engine: StageEngine | None = None
        self.weights: WeightUpdates | None = None
        self.authenticator: Authenticator = OpenAccess()
        """Who gets in (the interceptor checks it); weight calls also ask `require_admin`."""
        self.eos_token_ids: list[int] = []
        self.max_model_len = 0
        self._session_lock = asyncio.Lock()
        self._session_peer = ""
        """The address of the scheduler whose session runs."""
        self.observer: StepHooks | None = None
        """Step metrics and spans, or None: no hook runs."""
        self.recorder: PlanRecorder | None = None
        """`--record-plans`: where every plan received is written, or None."""

    def set_engine(self, engine: StageEngine, eos_token_ids: list[int], max_model_len: int) -> None:
        self.engine = engine
        self.weights = WeightUpdates(engine)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    async def Describe(self, request, context):
        if self.engine is None:
            return worker_pb2.DescribeResponse(
                stage=self.stage,
                num_stages=self.num_stages,
                ready=False,
                model_name=self.model_name,
                tp_rank=self.tp_rank,
                tensor_parallel_size=self.tp_size,
            )
        runner = self.engine.runner
        spec = runner.model.stage
        return worker_pb2.DescribeResponse(
            stage=self.stage,
            num_stages=self.engine.num_stages,
            first_layer=spec.layer_ids.start,
            num_layers=spec.num_layers,
            num_kv_blocks=runner.kv_cache.num_blocks,
            block_size=runner.kv_cache.block_size,
            ready=True,
            model_name=self.model_name,
            max_model_len=self.max_model_len,
            vocab_size=runner.model.config.vocab_size,
            eos_token_ids=self.eos_token_ids,
            device=runner.device_kind,
            quantization=runner.model.quantization.method if runner.model.quantization else "",
            tp_rank=self.tp_rank,
            tensor_parallel_size=self.tp_size,
            weight_version=self.weights.version,
        )

    async def GetTimeline(self, request, context):
        if self.engine is None:
            return worker_pb2.Timeline(stage=self.stage)
        timeline = self.engine.timeline
        busy, bubble, plan_wait = timeline.fractions()
        reply = worker_pb2.Timeline(
            stage=self.stage,
            busy_fraction=busy,
            bubble_fraction=bubble,
            plan_wait_fraction=plan_wait,
            num_steps=len(timeline.records),
        )
        if request.include_steps:
            reply.steps.extend(
                worker_pb2.StepTiming(
                    step_id=r.step_id,
                    num_requests=r.num_requests,
                    num_tokens=r.num_tokens,
                    start_ns=r.start_ns,
                    end_ns=r.end_ns,
                    wait_ns=r.wait_ns,
                    collective_ns=r.collective_ns,
                    plan_wait_ns=r.plan_wait_ns,
                )
                for r in timeline.records
            )
        if request.reset:
            timeline.clear()
        return reply

    async def Run(self, request_iterator, context):
        if self.engine is None:
            raise PipelineUnavailable(f"stage {self.stage} is still loading its model")
        # A scheduler re-forming the pipeline may arrive while the previous session is still
        # winding down (its waits are aborted, so that takes moments): wait for it, a while.
        # A session that goes on is another scheduler's (a --workers list that names this
        # stage twice): refused, or both would stall with plans nobody reads.
        try:
            await asyncio.wait_for(self._session_lock.acquire(), SESSION_WAIT_S)
        except TimeoutError:
            raise PipelineUnavailable(
                f"stage {self.stage} serves another scheduler's session (from "
                f"{self._session_peer}), or its last step has not ended (a hung stage): one "
                "scheduler drives a pipeline; check the --workers of both"
            ) from None
        self._session_peer = context.peer()
        try:
            loop = asyncio.get_running_loop()
            reports: asyncio.Queue = asyncio.Queue()
            # The last stage's tp rank 0 reports tokens; its peers hold the same ones.
            reports_tokens = self.engine.transport.is_last and self.tp_rank == 0
            # Stage 0's rank 0 reports the plans it waited for (async: the scheduler's window).
            reports_waits = self.engine.transport.is_first and self.tp_rank == 0
            observer = self.observer

            def on_outcome(outcome: StepOutcome) -> None:
                if observer is not None:
                    observer.on_outcome(outcome)
                if reports_tokens or outcome.error or (reports_waits and outcome.plan_wait_ns):
                    loop.call_soon_threadsafe(reports.put_nowait, outcome)

            joined: asyncio.Future = loop.create_future()

            def on_joined(error: str | None) -> None:
                loop.call_soon_threadsafe(lambda: joined.done() or joined.set_result(error))

            metadata = dict(context.invocation_metadata() or ())
            epoch = int(metadata.get("conveyor-epoch", "0"))
            self.engine.start(on_outcome, epoch, on_joined)
            if self.recorder is not None:
                self.recorder.session_started()
            reader = None
            try:
                # Once the stages formed the pipeline (the rendezvous ended), this stage says
                # it took the session: the scheduler reports SERVING only once every stage
                # has. A stage that cannot join ends the session, saying why.
                if (error := await joined) is not None:
                    raise PipelineUnavailable(error)
                await context.send_initial_metadata(((SESSION_ACCEPTED, "1"),))
                reader = asyncio.create_task(self._read_plans(request_iterator, reports))
                # One await per report: the loop thread holds the GIL briefly, and the compute
                # thread (which hands reports over between steps) gets it back sooner.
                while (outcome := await reports.get()) is not None:
                    yield outcome_to_pb(outcome, self.stage)
            finally:
                if reader is not None:
                    reader.cancel()
                await asyncio.shield(asyncio.to_thread(self.engine.stop))
                if observer is not None:
                    observer.reset()
                logger.info("stage %d: session ended", self.stage)
        finally:
            self._session_lock.release()

    # -- weight updates (the scheduler's UpdateWeights and InitWeightTransfer) ---------------
    def _weights(self, context) -> WeightUpdates:
        require_admin(context, self.authenticator)
        if self.weights is None:
            raise PipelineUnavailable(f"stage {self.stage} is still loading its model")
        return self.weights

    async def InitWeightTransfer(self, request, context):
        self._weights(context).init_transfer(
            request.master_addr,
            request.master_port,
            request.rank,
            request.world_size,
            request.timeout_s or 300.0,
        )
        return worker_pb2.StageTransferResponse()

    async def StageWeights(self, request, context):
        weights = self._weights(context)
        reply = worker_pb2.StageWeightsReply
        if request.path:
            stage = weights.plan_files(request.path, list(request.layers), request.weight_version)
        else:
            stage = weights.plan_received(request.weight_version)
        yield reply(phase=reply.PHASE_ACCEPTED)
        num_tensors = await run_in_own_thread(stage, name="weights-stage")
        yield reply(phase=reply.PHASE_STAGED, num_tensors=num_tensors)

    async def CommitWeights(self, request, context):
        version = await asyncio.to_thread(
            self._weights(context).commit, request.weight_version, request.discard
        )
        return worker_pb2.CommitWeightsResponse(weight_version=version)

    async def _read_plans(self, request_iterator, reports: asyncio.Queue) -> None:
        """Feeds plans to the engine; puts None on `reports` when the stream ends. A plan
        that cannot be run ends the session with an error report naming its step (the
        scheduler re-forms the pipeline)."""
        observer = self.observer
        last_step_id = None
        try:
            async for msg in request_iterator:
                for plan in (msg, *msg.following):  # several plans joined in one message
                    try:
                        step = _parse_plan(plan, plan is not msg, last_step_id)
                    except ValueError as exc:
                        error = f"stage {self.stage}: step {plan.step_id} {exc}"
                        logger.error("%s", error)
                        reports.put_nowait(StepOutcome(plan.step_id, None, error=error))
                        return
                    last_step_id = plan.step_id
                    if observer is not None:
                        observer.on_plan(plan)
                    if self.recorder is not None:
                        self.recorder.plan(plan)
                    self.engine.submit(step, plan.tokens_from_last_stage)
        finally:
            reports.put_nowait(None)  # the scheduler closed the stream (or it broke)


def _parse_plan(msg: worker_pb2.StepPlan, is_joined: bool, last_step_id: int | None):
    """The plan of `msg`, checked like a client's request where it enters the worker;
    raises ValueError saying what is wrong (after "step N")."""
    if is_joined and msg.following:
        raise ValueError("nests plans (never sent)")
    if last_step_id is not None and msg.step_id <= last_step_id:
        raise ValueError(f"came after step {last_step_id}: step ids only increase in a session")
    try:
        return plan_from_pb(msg)  # sampling parameters are validated here
    except ValueError as exc:
        raise ValueError(f"is malformed: {exc}") from exc


HUNG_EXIT = 70
"""What a worker exits with when a step computed longer than --hang-timeout (EX_SOFTWARE)."""


def watch_steps(engine: StageEngine, timeout_s: float) -> None:
    """Ends the process once a step has computed for longer than `timeout_s` (runs on a
    thread of its own, for good). A wedged kernel or collective never returns, and the
    stage is useless until a fresh process takes it: its supervisor (`conveyor up`,
    compose's restart policy, Kubernetes) starts one, and the scheduler, NOT_SERVING since
    its --step-timeout, re-forms the pipeline with it."""
    interval_s = min(1.0, timeout_s / 4)
    while True:
        time.sleep(interval_s)
        since = engine.computing_since
        if since is not None and time.monotonic() - since > timeout_s:
            logger.critical(
                "%s: a step has computed for more than %g s (--hang-timeout): exiting with "
                "code %d so that a fresh worker takes the stage",
                engine.name,
                timeout_s,
                HUNG_EXIT,
            )
            os._exit(HUNG_EXIT)


def internal_server(name: str, service: str, config: WorkerConfig) -> GrpcServer:
    """The gRPC server of a worker (stage or draft) with the internal services' security;
    it takes 64 MiB messages: a plan, or a scheduler's first draft call, carries every new
    prompt whole."""
    from services.common.security import internal_server_security

    return GrpcServer(
        name,
        config.host,
        config.port,
        [service],
        options=[("grpc.max_receive_message_length", 64 << 20)],
        security=internal_server_security(
            config.tls_cert, config.tls_key, config.tls_ca, config.internal_token
        ),
        health_port=config.health_port,
    )


async def load_stage(config: WorkerConfig):
    """The stage's runner and transport: weights and KV cache, or with --device sim the
    timing model."""
    import torch

    from services.worker.transport import StageTransport

    if config.device == "sim":  # every real part, the forward pass modeled
        from services.worker.sim.stage import build_sim_stage

        return await run_in_own_thread(build_sim_stage, config)
    if config.rank_device.startswith("cuda:"):  # NCCL binds the current device
        torch.cuda.set_device(config.rank_device)
    runner = await run_in_own_thread(StageRunner.from_config, config)
    transport = StageTransport(
        config.stage_index,
        config.num_stages,
        config.dist_addr,
        torch.device(config.rank_device),
        bind_host=config.host,
        secret=config.internal_token,
        tp_rank=config.tp_rank,
        tp_size=config.tensor_parallel_size,
    )
    return runner, transport


async def serve(config: WorkerConfig) -> None:
    """Loads the stage, serves it until SIGTERM/SIGINT, then drains gracefully."""
    from services.worker.observability import install as install_observers

    server = internal_server(f"stage {config.stage_index}", _SERVICE, config)
    model_name = Path(config.model_dir).name
    servicer = StageWorkerServicer(
        config.stage_index,
        config.num_stages,
        model_name,
        config.tp_rank,
        config.tensor_parallel_size,
    )
    servicer.authenticator = server.security.authenticator
    if config.record_plans:
        servicer.recorder = PlanRecorder(config.record_plans, config)
    server.add(worker_pb2_grpc.add_StageWorkerServicer_to_server, servicer)
    close_observers = install_observers(
        servicer, config.stage_index, config.metrics_port, config.otlp_endpoint
    )
    await server.start()
    logger.info("stage %d/%d: loading %s", config.stage_index, config.num_stages, config.model_dir)
    try:
        runner, transport = await load_stage(config)
    except BaseException:
        # Stop the started server while the loop still runs: left to the garbage collector,
        # its __del__ schedules the shutdown on the loop asyncio.run has closed by then, and
        # a refused start ends in "Exception ignored ... Event loop is closed".
        await server.stop(grace_s=0)
        raise
    eos = runner.model.config.eos_token_ids
    max_model_len = config.max_model_len or runner.model.config.max_position_embeddings
    engine = StageEngine(runner, transport)
    servicer.set_engine(engine, list(eos), max_model_len)
    if config.hang_timeout_s:
        args = (engine, config.hang_timeout_s)
        threading.Thread(target=watch_steps, args=args, name="hang-watchdog", daemon=True).start()
    await server.set_serving(True)
    layers = runner.model.stage.layer_ids
    logger.info(
        "stage %d/%d serving on port %d: layers %d-%d, %d KV blocks of %d tokens",
        config.stage_index,
        config.num_stages,
        config.port,
        layers.start,
        layers.stop - 1,
        runner.kv_cache.num_blocks,
        runner.kv_cache.block_size,
    )
    await server.wait_for_stop()
    await server.stop(grace_s=5)
    close_observers()
    if servicer.recorder is not None:
        servicer.recorder.close()
