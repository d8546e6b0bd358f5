"""`SimStageRunner`: a stage's real bookkeeping, with the forward pass replaced by a sleep.

What stays real (inherited from `StageRunner`): applying the plan's deltas to the
per-request state (token ids, block tables, computed-token counts), building the step's
metadata (positions, slot mapping, block tables; stage 0 checks it holds every input
token), and which rows sample. What is modeled: the forward pass and sampling take
`StageTimingModel.step(...)` seconds, spent in `time.sleep`, and the "sampled" tokens come
from `TokenSource` (deterministic per request and position).

Between stages a small real tensor [T, 4] stands in for the hidden states [T, H]:

    column 0: step id    1: send time (set by SimLink)    2: position    3: KV slot

The next stage checks that it received this step's rows (the same positions and slots it
computed itself), so a mis-routed or reordered message fails the step as it would corrupt
a real pipeline.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from services.common.step import StepPlan, StepResult
from services.kernels.metadata import AttentionMetadata
from services.worker.config import WorkerConfig
from services.worker.model.config import ModelConfig
from services.worker.model.stages import StageSpec, logits_layer_equivalents, stage_spec
from services.worker.runner import RequestState, ScheduledBatch, StageRunner, StepTiming
from services.worker.sim.clock import Sleeper
from services.worker.sim.profiles import HardwareProfile, load_profile
from services.worker.sim.timing import StageTimingModel, StepCost
from services.worker.sim.tokens import TokenSource, request_key

logger = logging.getLogger(__name__)

WIRE_WIDTH = 4
WIRE_DTYPE = torch.float64
COL_STEP, COL_SENT_AT, COL_POSITION, COL_SLOT = range(WIRE_WIDTH)


@dataclass(slots=True)
class SimKVCache:
    """The KV pool a stage reports: its size only (no memory is allocated)."""

    num_blocks: int
    block_size: int


class SimStageModel:
    """What the engine and the servicer read off a runner's `model`: the architecture, the
    stage's layers, and (first parameter) the dtype of the activations on the wire."""

    def __init__(self, config: ModelConfig, stage: StageSpec) -> None:
        self.config, self.stage = config, stage
        self.quantization = None
        """No weights, so nothing quantized (Describe reads it)."""
        self._wire = torch.empty(0, dtype=WIRE_DTYPE)
        self.quantization = None  # no weights, none quantized (Describe and metrics read it)

    def parameters(self):
        return iter([self._wire])


class SimStageRunner(StageRunner):
    """Executes step plans like `StageRunner`, sleeping the modeled time of each step."""

    def __init__(
        self,
        model: SimStageModel,
        kv_cache: SimKVCache,
        timing: StageTimingModel,
        tokens: TokenSource,
    ) -> None:
        super().__init__(model, kv_cache)
        self.timing_model = timing
        self.tokens = tokens
        self.sleeper = Sleeper()
        self.last_cost = StepCost()
        self.modeled_s = 0.0
        """Sum of the modeled step times (what the device would have been busy)."""
        self._keys: dict[str, tuple[RequestState, int]] = {}
        """Each request's token key, beside the state it was computed for (a request sent
        whole again gets a new state, and its key is computed again)."""

    @property
    def device_kind(self) -> str:
        return self.timing_model.profile.device_kind

    @classmethod
    def from_config(cls, config: WorkerConfig) -> SimStageRunner:
        """The stage `config` describes, timed on its profile; nothing is loaded but the
        model's config.json (and tokenizer.json, for the ids to sample)."""
        torch.set_num_threads(1)  # a few small tensor ops per step; no spinning threads
        model_config = ModelConfig.from_dir(config.model_dir)
        profile = sim_profile(config)
        logits_cost = logits_layer_equivalents(
            model_config.vocab_size, model_config.hidden_size, model_config.num_layer_params
        )  # the same split as a real worker's (see model/stages.py)
        stage = stage_spec(
            model_config.num_hidden_layers,
            config.num_stages,
            config.stage_index,
            config.layer_split,
            last_stage_extra=logits_cost,
        )
        timing = StageTimingModel(
            model_config,
            profile,
            stage.num_layers,
            stage.is_first,
            stage.is_last,
            config.sim_tensor_parallel_size,
        )
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        num_blocks = timing.num_kv_blocks(config.block_size, config.kv_cache_memory, max_model_len)
        tokens = TokenSource.from_model_dir(
            config.model_dir, model_config.vocab_size, model_config.eos_token_ids
        )
        logger.info(
            "stage %d: simulated %s (%s), TP %d: %.2f GB of weights, %d KV blocks",
            config.stage_index,
            profile.name,
            profile.description,
            config.sim_tensor_parallel_size,
            timing.weight_bytes / 1e9,
            num_blocks,
        )
        return cls(
            SimStageModel(model_config, stage),
            SimKVCache(num_blocks, config.block_size),
            timing,
            tokens,
        )

    # ---------------------------------------------------------------- execute
    def execute(
        self,
        plan: StepPlan,
        hidden_in: torch.Tensor | None = None,
        input_token_ids: dict[str, int] | None = None,
    ) -> torch.Tensor | StepResult:
        """Run one step: the real bookkeeping, then the modeled time asleep. Returns the
        wire tensor [T, 4] (not last stage) or a StepResult."""
        t0 = time.perf_counter()
        for request_id in plan.finished_request_ids:
            self._keys.pop(request_id, None)
        batch = self._apply_plan(plan, input_token_ids)
        if not batch.states:
            return StepResult(plan.step_id, [], []) if self.stage.is_last else hidden_in
        meta, _ = self._prepare(batch)
        if hidden_in is not None:
            self._check_wire(plan.step_id, hidden_in, meta)
        for state, num in zip(batch.states, batch.num_scheduled, strict=True):
            state.num_computed_tokens += num
        num_sampled = 0
        if self.stage.is_last:
            num_sampled = sum(s.num_computed_tokens >= len(s.token_ids) for s in batch.states)
        cost = self.timing_model.step(batch.num_scheduled, meta.seq_lens.tolist(), num_sampled)
        t1 = time.perf_counter()
        self.sleeper.sleep_for(cost.total_s)
        t2 = time.perf_counter()
        out = (
            self._sample_sim(plan.step_id, batch) if self.stage.is_last else self._wire(plan, meta)
        )
        t3 = time.perf_counter()
        self.last_cost, self.modeled_s = cost, self.modeled_s + cost.total_s
        self.last_timing = StepTiming(t1 - t0, t2 - t1, t3 - t2)
        self.timing.prepare_s += t1 - t0
        self.timing.forward_s += t2 - t1
        self.timing.sample_s += t3 - t2
        return out

    def _wire(self, plan: StepPlan, meta: AttentionMetadata) -> torch.Tensor:
        wire = torch.zeros(meta.positions.shape[0], WIRE_WIDTH, dtype=WIRE_DTYPE)  # [T, 4]
        rows = wire.numpy()  # a view: numpy's small ops cost ~1 µs, torch's several each
        rows[:, COL_STEP] = plan.step_id
        rows[:, COL_POSITION] = meta.positions.numpy()
        rows[:, COL_SLOT] = meta.slot_mapping.numpy()
        return wire

    def _check_wire(self, step_id: int, wire: torch.Tensor, meta: AttentionMetadata) -> None:
        """The previous stage's rows must be this step's: same step, positions and slots."""
        if wire.shape != (meta.positions.shape[0], WIRE_WIDTH):
            raise ValueError(
                f"stage {self.stage.stage_index}: step {step_id} expected activations of "
                f"{meta.positions.shape[0]} tokens, got {list(wire.shape)}"
            )
        rows = wire.numpy()
        if not (rows[:, COL_STEP] == step_id).all():
            steps = np.unique(rows[:, COL_STEP]).tolist()
            raise ValueError(
                f"stage {self.stage.stage_index}: received activations of step(s) {steps} "
                f"for step {step_id}"
            )
        if not (
            np.array_equal(rows[:, COL_POSITION], meta.positions.numpy())
            and np.array_equal(rows[:, COL_SLOT], meta.slot_mapping.numpy())
        ):
            raise ValueError(
                f"stage {self.stage.stage_index}: step {step_id}'s activations disagree with "
                "this stage's positions or KV slots (the stages' request state diverged)"
            )

    def _sample_sim(self, step_id: int, batch: ScheduledBatch) -> StepResult:
        """One deterministic token for every request whose chunk reached its end."""
        states = [s for s in batch.states if s.num_computed_tokens >= len(s.token_ids)]
        token_ids = self.tokens.tokens(
            [self._key(s) for s in states],
            [len(s.token_ids) for s in states],
            # no EOS before min_tokens, as the real sampler masks it
            [
                s.sampling.ignore_eos
                or len(s.token_ids) - s.num_prompt_tokens < s.sampling.min_tokens
                for s in states
            ],
        )
        logprobs = None
        for index, (state, token) in enumerate(zip(states, token_ids, strict=True)):
            state.token_ids.append(token)
            if state.sampling.logprobs is not None:
                logprobs = logprobs or [None] * len(states)
                logprobs[index] = self.tokens.logprobs(token, state.sampling.logprobs)
        return StepResult(step_id, [s.request_id for s in states], token_ids, logprobs)

    def _key(self, state: RequestState) -> int:
        cached = self._keys.get(state.request_id)
        if cached is None or cached[0] is not state:
            key = request_key(state.sampling, state.token_ids[: state.num_prompt_tokens])
            cached = self._keys[state.request_id] = (state, key)
        return cached[1]


def sim_profile(config: WorkerConfig) -> HardwareProfile:
    """The worker's profile (the CPU variant of its --threads), link flags applied."""
    profile = load_profile(config.sim_profile, threads=config.threads)
    bandwidth = None if config.sim_link_bandwidth is None else config.sim_link_bandwidth * 1e9
    latency = None if config.sim_link_latency is None else config.sim_link_latency * 1e-6
    return profile.with_link(bandwidth, latency)
