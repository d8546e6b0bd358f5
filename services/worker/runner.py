"""`StageRunner`: runs one pipeline stage's share of each StepPlan.

It keeps the per-request state the plans are deltas against (block table, token ids,
computed-token count, sampling params), turns a plan into one flattened batch
(input ids / positions / slots / block tables) in a single vectorised numpy pass (the block
tables are rows of a persistent array, block_tables.py), runs the stage's layers over the
paged KV cache and, on the last stage, samples one token for every request whose chunk
reaches the end of its known tokens.

Speculative steps (docs/speculative-decoding.md): an entry's proposed tokens are computed
after its scheduled ones, k + 1 positions in all. The last stage samples each of those rows
as the token at that position would be sampled without speculation, and keeps the tokens
up to the first one that differs from the proposal (`accept_proposal`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from services.common.errors import UnknownRequest
from services.common.sampling import SamplingParams
from services.common.step import StepPlan, StepResult
from services.kernels.metadata import AttentionMetadata
from services.worker.block_tables import BlockTables
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KVCache, KVCacheSpec
from services.worker.model.config import ModelConfig
from services.worker.model.llama import StageModel
from services.worker.model.loader import resolve_dtype
from services.worker.model.quant import load_quantized_stage
from services.worker.model.stages import logits_layer_equivalents, stage_spec
from services.worker.sampler import Sampler, SamplingBatch, argmax_rows

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestState:
    """What a worker remembers about one request between steps."""

    request_id: str
    token_ids: list[int]
    """Prompt + outputs known to this stage (stage 0 and the last stage keep it exact)."""
    num_prompt_tokens: int
    sampling: SamplingParams
    row: int
    """Its block table's row in the runner's `BlockTables`."""
    num_computed_tokens: int


@dataclass(slots=True)
class ScheduledBatch:
    """The requests of one step in batch order, with their tokens this step."""

    states: list[RequestState]
    num_scheduled: list[int]
    """Positions computed per request: its scheduled tokens and its proposed ones."""
    spec_token_ids: list[list[int]]
    """Per request, the proposed tokens (the last positions of its chunk); mostly empty."""


MAX_SPEC_TOKENS = 64
"""Most proposed tokens one plan entry may carry (the scheduler's limit is far lower)."""


def accept_proposal(sampled: list[int], proposal: list[int]) -> list[int]:
    """The tokens a speculative step yields: `sampled` [k + 1] are the tokens sampled at the
    k + 1 positions, each as if every proposed token before it were right; keep them up to
    and including the first that differs from `proposal` [k] (all k + 1 if none does)."""
    num_accepted = 0
    while num_accepted < len(proposal) and sampled[num_accepted] == proposal[num_accepted]:
        num_accepted += 1
    return sampled[: num_accepted + 1]


@dataclass(slots=True)
class StepTiming:
    """Seconds this stage spent per step: building inputs, the forward, sampling."""

    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return self.prepare_s + self.forward_s + self.sample_s


class StageRunner:
    """Holds one stage's model, KV cache and request states; executes step plans."""

    def __init__(
        self,
        model: StageModel,
        kv_cache: KVCache,
        sampler: Sampler | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.stage = model.stage
        self.sampler = sampler or Sampler(device=device)
        self.device = torch.device(device)
        # The scheduler finishes requests on any of the model's EOS ids (scheduler/service.py);
        # the sampler masks those same ids until min_tokens.
        self.eos_token_ids = model.config.eos_token_ids
        self.requests: dict[str, RequestState] = {}
        """Held requests; dropping one (here or by a caller) frees its block table row."""
        self.block_tables = BlockTables(lambda: (s.row for s in self.requests.values()))
        self.timing = StepTiming()
        self.last_timing = StepTiming()
        self.last_logits: torch.Tensor | None = None
        """[N, V] logits of the rows sampled in the last step (last stage only): float32, or
        the model's dtype when every row was plain greedy (`compute_logits`)."""

    @property
    def device_kind(self) -> str:
        """The device Describe reports ("cpu", "cuda"; a simulated stage: the one it models)."""
        return self.device.type

    @classmethod
    def from_config(cls, config: WorkerConfig) -> StageRunner:
        """Load this stage's weights and allocate its KV cache from the budget."""
        torch.set_num_threads(config.threads)
        model_config = ModelConfig.from_dir(config.model_dir)
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        logits_cost = logits_layer_equivalents(
            model_config.vocab_size, model_config.hidden_size, model_config.num_layer_params
        )  # the default split balances work, not layers (see model/stages.py)
        stage = stage_spec(
            model_config.num_hidden_layers,
            config.num_stages,
            config.stage_index,
            config.layer_split,
            last_stage_extra=logits_cost,
        )
        model = load_quantized_stage(
            config.model_dir,
            stage,
            config.dtype,
            config.quantization,
            ignore=config.quantization_ignore,
            attention_backend=config.effective_attention_backend,
            max_positions=max(max_model_len, model_config.max_position_embeddings),
            tp_rank=config.tp_rank,
            tensor_parallel_size=config.tensor_parallel_size,
        ).to(config.rank_device)
        if config.uses_onednn or config.uses_cpu_kernels:  # see PackedLinear: bf16 on AVX2
            model.use_onednn(keep_plain=config.uses_cpu_kernels)
        if config.uses_cpu_kernels:
            model.use_fused_cpu_ops()
        spec = KVCacheSpec(
            stage.num_layers,
            model.tp.shard.num_kv_heads,  # this rank's share of the KV cache
            model_config.head_dim,
            config.block_size,
            resolve_dtype(config.dtype),
        )
        device = config.rank_device
        kv_cache = KVCache.from_budget(spec, config.kv_cache_memory, max_model_len, device)
        return cls(model, kv_cache, Sampler(config.seed, device), device)

    # ---------------------------------------------------------------- plan deltas
    def _apply_plan(self, plan: StepPlan, input_token_ids: dict[str, int] | None) -> ScheduledBatch:
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        batch = ScheduledBatch([], [], [])
        for new in plan.new_requests:
            self._check_ids(plan.step_id, new.request_id, new.token_ids, new.block_ids)
            state = RequestState(
                new.request_id,
                list(new.token_ids),
                new.num_prompt_tokens,
                new.sampling,
                self.block_tables.add(new.block_ids),
                new.num_computed_tokens,
            )
            self.requests[new.request_id] = state
            batch.states.append(state)
            batch.num_scheduled.append(new.num_scheduled_tokens)
            batch.spec_token_ids.append([])
        for cached in plan.cached_requests:
            state = self.requests.get(cached.request_id)
            if state is None:
                raise UnknownRequest(
                    f"step {plan.step_id}: stage {self.stage.stage_index} does not hold request "
                    f"{cached.request_id!r} (never sent as new, or already finished)"
                )
            if cached.new_token_ids or cached.new_block_ids:
                self._check_ids(
                    plan.step_id, cached.request_id, cached.new_token_ids, cached.new_block_ids
                )
            if cached.new_block_ids:
                self.block_tables.append(state.row, cached.new_block_ids)
            if cached.spec_token_ids or cached.num_computed_tokens is not None:
                self._check_spec(plan.step_id, state, cached)
            if cached.num_computed_tokens is not None:  # rolls back rejected proposals
                state.num_computed_tokens = cached.num_computed_tokens
            needed = state.num_computed_tokens + cached.num_scheduled_tokens
            new_tokens = cached.new_token_ids
            if not new_tokens and input_token_ids and cached.request_id in input_token_ids:
                new_tokens = [input_token_ids[cached.request_id]]
            if new_tokens:  # the plan (or the last stage) is authoritative for these tokens
                del state.token_ids[needed - len(new_tokens) :]
                state.token_ids.extend(new_tokens)
            if cached.spec_token_ids and needed < len(state.token_ids):
                raise ValueError(
                    f"step {plan.step_id}: request {cached.request_id!r} carries proposed "
                    "tokens but its chunk does not reach the end of its known tokens"
                )
            batch.states.append(state)
            batch.num_scheduled.append(cached.num_step_tokens)
            batch.spec_token_ids.append(cached.spec_token_ids)
        return batch

    def _check_ids(
        self, step_id: int, request_id: str, token_ids: list[int], block_ids: list[int]
    ) -> None:
        """A plan's ids index the embedding and the KV cache: one past them fails the step
        here, with a message (on CUDA, indexing with it is a device assert that ends the
        process; on CPU an IndexError that says nothing of the plan)."""
        where = f"step {step_id}: request {request_id!r}"
        vocab_size, num_blocks = self.model.config.vocab_size, self.kv_cache.num_blocks
        if token_ids and not (min(token_ids) >= 0 and max(token_ids) < vocab_size):
            bad = next(t for t in token_ids if not 0 <= t < vocab_size)
            raise ValueError(f"{where}: token id {bad} is outside [0, {vocab_size})")
        if block_ids and not (min(block_ids) >= 0 and max(block_ids) < num_blocks):
            bad = next(b for b in block_ids if not 0 <= b < num_blocks)
            raise ValueError(f"{where}: block id {bad} is outside the KV cache [0, {num_blocks})")

    def _check_spec(self, step_id: int, state: RequestState, cached) -> None:
        """A plan's speculative fields must be possible: a bad one fails the step."""
        vocab_size = self.model.config.vocab_size
        where = f"step {step_id}: request {cached.request_id!r}"
        if len(cached.spec_token_ids) > MAX_SPEC_TOKENS:
            raise ValueError(
                f"{where} carries {len(cached.spec_token_ids)} proposed tokens "
                f"(at most {MAX_SPEC_TOKENS})"
            )
        if any(not 0 <= t < vocab_size for t in cached.spec_token_ids):
            raise ValueError(f"{where}: a proposed token id is outside [0, {vocab_size})")
        rollback = cached.num_computed_tokens
        if rollback is not None and not 0 <= rollback <= state.num_computed_tokens:
            raise ValueError(
                f"{where}: num_computed_tokens={rollback} may only roll back, from "
                f"{state.num_computed_tokens}"
            )

    # ---------------------------------------------------------------- inputs
    def _prepare(self, batch: ScheduledBatch) -> tuple[AttentionMetadata, torch.Tensor | None]:
        """Metadata (and stage 0's input ids) of the flattened batch, built in one pass."""
        block_size = self.kv_cache.block_size
        states = batch.states
        num_seqs = len(states)
        starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, num_seqs)  # [B]
        rows = np.fromiter((s.row for s in states), np.int64, num_seqs)  # [B]
        query_lens = np.array(batch.num_scheduled, dtype=np.int64)  # [B]
        seq_lens = starts + query_lens  # [B]
        block_tables = self.block_tables.gather(rows)  # [B, max_blocks] int32
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)  # [B + 1]
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_of_row = np.repeat(np.arange(num_seqs), query_lens)  # [T]
        positions = np.arange(num_tokens) - query_start_loc[seq_of_row] + starts[seq_of_row]
        slot_mapping = (
            block_tables[seq_of_row, positions // block_size].astype(np.int64) * block_size
            + positions % block_size
        )  # [T]
        input_ids = None
        if self.stage.is_first:
            input_ids = self._input_ids(batch, starts.tolist(), num_tokens)
        device = self.device
        meta = AttentionMetadata(
            positions=torch.from_numpy(positions).to(device),
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            block_tables=torch.from_numpy(block_tables).to(device),
            max_query_len=max(batch.num_scheduled),
            max_seq_len=int(seq_lens.max()),
        )
        return meta, input_ids

    def _input_ids(self, batch: ScheduledBatch, starts: list[int], num_tokens: int) -> torch.Tensor:
        """[T] the tokens stage 0 embeds: each request's chunk, then its proposed tokens."""
        ids: list[int] = []
        rows = zip(batch.states, starts, batch.num_scheduled, batch.spec_token_ids, strict=True)
        for state, start, num, spec in rows:
            ids += state.token_ids[start : start + num - len(spec)]
            ids += spec
        if len(ids) != num_tokens:
            raise ValueError("a scheduled request lacks the input tokens of this step")
        return torch.from_numpy(np.array(ids, dtype=np.int64)).to(self.device)

    # ---------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute(
        self,
        plan: StepPlan,
        hidden_in: torch.Tensor | None = None,
        input_token_ids: dict[str, int] | None = None,
    ) -> torch.Tensor | StepResult:
        """Run one step. Returns hidden states [T, hidden] (not last stage) or a StepResult.

        Args:
            plan: the step's plan (the same on every stage).
            hidden_in: [T, hidden] from the previous stage (every stage but the first).
            input_token_ids: async mode, stage 0: decode input tokens by request id, as sent
                by the last stage instead of the plan's `new_token_ids`.
        """
        t0 = time.perf_counter()
        batch = self._apply_plan(plan, input_token_ids)
        if not batch.states:
            return StepResult(plan.step_id, [], []) if self.stage.is_last else hidden_in
        meta, input_ids = self._prepare(batch)
        t1 = time.perf_counter()
        hidden = self.model(
            meta, self.kv_cache.layers, input_ids=input_ids, hidden_states=hidden_in
        )
        for state, num in zip(batch.states, batch.num_scheduled, strict=True):
            state.num_computed_tokens += num
        t2 = time.perf_counter()
        out = self._sample(plan.step_id, batch, hidden, meta) if self.stage.is_last else hidden
        t3 = time.perf_counter()
        self.last_timing = StepTiming(t1 - t0, t2 - t1, t3 - t2)
        self.timing.prepare_s += t1 - t0
        self.timing.forward_s += t2 - t1
        self.timing.sample_s += t3 - t2
        return out

    def _is_plain_greedy(self, state: RequestState) -> bool:
        """Greedy, no penalties, no logprobs, no token masked (min_tokens): its token is the
        argmax of its logits, which the sampler would return after building a batch of
        per-row tensors (~15 small tensors a step, a real share of one request's step)."""
        params = state.sampling
        num_output = len(state.token_ids) - state.num_prompt_tokens
        return (
            params.is_greedy
            and not params.has_penalties
            and params.logprobs is None
            and not params.masked_token_ids(num_output, self.eos_token_ids)
        )

    def _sample(
        self, step_id: int, batch: ScheduledBatch, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> StepResult:
        """Logits for the rows that reach the end of their known tokens, then sample.

        A request with k proposed tokens has k + 1 such rows: row i is sampled with the
        proposal's first i tokens as its latest outputs (penalties, min_tokens, the seeded
        generator's position), exactly as a step without speculation would sample there.
        """
        rows, states, specs = [], [], []
        ends = meta.query_start_loc[1:].tolist()
        for state, end, spec in zip(batch.states, ends, batch.spec_token_ids, strict=True):
            if state.num_computed_tokens < len(state.token_ids) + len(spec):
                continue
            states.append(state)
            specs.append(spec)
            rows.extend(range(end - 1 - len(spec), end))
        if not states:
            return StepResult(step_id, [], [])
        greedy = all(self._is_plain_greedy(s) for s in states)
        # [R, V], float32 unless every row is greedy (then as computed); None: tp rank > 0
        logits = self.model.compute_logits(hidden[rows], float32=not greedy)
        logprobs = None
        if logits is not None and greedy:
            sampled = argmax_rows(logits)  # what the sampler gives them, without its tensors
        elif logits is not None:
            # per row: its request, and the outputs it is sampled after (copies: only here)
            row_states = [
                s for s, spec in zip(states, specs, strict=True) for _ in range(len(spec) + 1)
            ]
            outputs = [
                s.token_ids[s.num_prompt_tokens :] + spec[:i]
                for s, spec in zip(states, specs, strict=True)
                for i in range(len(spec) + 1)
            ]
            sampling_batch = SamplingBatch.from_requests(
                [s.sampling for s in row_states],
                [s.token_ids[: s.num_prompt_tokens] for s in row_states],
                outputs,
                device=self.device,
                eos_token_ids=self.eos_token_ids,
            )
            output = self.sampler(logits, sampling_batch)
            sampled, logprobs = output.token_ids.to(torch.int64), output.logprobs
        else:
            sampled = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        # Tensor parallel: rank 0 alone samples (one generator, whatever the seeds); every
        # rank needs the tokens (its request states, async forwarding to stage 0).
        row_tokens = self.model.tp.broadcast(sampled).tolist()
        request_ids, token_ids, kept_logprobs = [], [], []
        row = 0
        for state, spec in zip(states, specs, strict=True):
            emitted = accept_proposal(row_tokens[row : row + len(spec) + 1], spec)
            # The rejected proposals' positions are not computed: their KV is overwritten.
            state.num_computed_tokens -= len(spec) - (len(emitted) - 1)
            state.token_ids.extend(emitted)
            request_ids.extend([state.request_id] * len(emitted))
            token_ids.extend(emitted)
            if logprobs is not None:
                kept_logprobs.extend(logprobs[row : row + len(emitted)])
            row += len(spec) + 1
        self.last_logits = logits
        return StepResult(step_id, request_ids, token_ids, kept_logprobs if logprobs else None)
