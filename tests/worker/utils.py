"""Factories for worker tests: tiny HF models saved to disk, a tiny planner, HF references."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.sampling import SamplingParams
from services.common.step import CachedRequest, NewRequest, StepPlan, StepResult
from services.worker.kv_cache import KVCache, KVCacheSpec
from services.worker.model.config import ModelConfig
from services.worker.model.loader import resolve_dtype
from services.worker.model.quant import load_quantized_stage
from services.worker.model.stages import stage_spec
from services.worker.runner import StageRunner

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def make_tiny_model(
    out_dir: Path,
    arch: str = "llama",
    num_kv_heads: int = 2,
    tied: bool = False,
    rope_scaling: dict | None = None,
    num_layers: int = 3,
    seed: int = 0,
) -> Path:
    """Save a seeded random fp32 model with HF itself; 4 query heads of dim 16."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        initializer_range=0.1,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    if rope_scaling is not None:
        kwargs.update(rope_scaling=rope_scaling, rope_theta=500000.0)
    if arch == "mistral":
        kwargs["sliding_window"] = None
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).to(torch.float32)
    if arch == "qwen2":  # HF initialises biases to zero; make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(param, std=0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def make_prompts(num: int, vocab: int = 256, min_len: int = 3, max_len: int = 40, seed: int = 0):
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)
    ]


def make_runners(
    model_dir: Path,
    num_stages: int = 1,
    block_size: int = 16,
    num_blocks: int = 128,
    layer_split: list[int] | None = None,
    dtype: str = "float32",
    attention_backend: str = "torch",
    onednn: bool = False,
    quantization: str | None = None,
) -> list[StageRunner]:
    """One StageRunner per stage, in-process; by default on the torch reference paths,
    `attention_backend="cpu", onednn=True` is what a CPU worker runs."""
    config = ModelConfig.from_dir(model_dir)
    runners = []
    for index in range(num_stages):
        stage = stage_spec(config.num_hidden_layers, num_stages, index, layer_split)
        model = load_quantized_stage(
            model_dir, stage, dtype, quantization, attention_backend=attention_backend
        )
        if onednn:  # as --linear-backend auto: oneDNN, and few-row matmuls on cpu_ops
            model.use_onednn(keep_plain=True)
            model.use_fused_cpu_ops()
        spec = KVCacheSpec(
            stage.num_layers,
            config.num_key_value_heads,
            config.head_dim,
            block_size,
            resolve_dtype(dtype),
        )
        runners.append(StageRunner(model, KVCache(spec, num_blocks)))
    return runners


@dataclass
class _Req:
    request_id: str
    tokens: list[int]
    num_prompt: int
    max_new: int
    sampling: SamplingParams
    arrival_step: int
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_sent: int = 0  # tokens the workers have heard of
    is_known: bool = False
    scheduled: int = 0


class TinyPlanner:
    """A minimal sync-mode scheduler: chunked prefill, one decode per step, shuffled blocks."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        chunk_size: int | None = None,
        shuffle_seed: int | None = None,
        async_mode: bool = False,
    ) -> None:
        self.block_size, self.chunk_size = block_size, chunk_size
        self.async_mode = async_mode
        self.free = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self.free)
        self.requests: dict[str, _Req] = {}
        self.finished: list[str] = []
        self.step_id = 0
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.outputs: dict[str, list[int]] = {}

    def add(
        self,
        request_id: str,
        prompt: list[int],
        max_new: int,
        arrival_step: int = 0,
        sampling: SamplingParams | None = None,
    ) -> None:
        self.requests[request_id] = _Req(
            request_id,
            list(prompt),
            len(prompt),
            max_new,
            sampling or SamplingParams(max_tokens=max_new),
            arrival_step,
        )
        self.logits[request_id] = []

    @property
    def is_done(self) -> bool:
        return not self.requests

    def next_plan(self) -> StepPlan:
        plan = StepPlan(self.step_id, finished_request_ids=self.finished)
        self.finished = []
        for req in self.requests.values():
            if req.arrival_step > self.step_id:
                continue
            num = len(req.tokens) - req.num_computed
            if self.chunk_size is not None:
                num = min(num, self.chunk_size)
            req.scheduled = num
            if num == 0:
                continue
            needed = -(-(req.num_computed + num) // self.block_size)
            new_blocks = [self.free.pop() for _ in range(needed - len(req.blocks))]
            req.blocks.extend(new_blocks)
            if not req.is_known:
                plan.new_requests.append(
                    NewRequest(
                        req.request_id,
                        list(req.tokens),
                        req.num_prompt,
                        req.sampling,
                        list(req.blocks),
                        req.num_computed,
                        num,
                    )
                )
                req.is_known = True
            else:
                new_tokens = [] if self.async_mode else req.tokens[req.num_sent :]
                plan.cached_requests.append(
                    CachedRequest(req.request_id, num, new_blocks, new_tokens)
                )
            req.num_sent = len(req.tokens)
        self.step_id += 1
        return plan

    def apply(self, result: StepResult, logits: torch.Tensor | None = None) -> None:
        for req in self.requests.values():
            req.num_computed += req.scheduled
            req.scheduled = 0
        for row, (request_id, token_id) in enumerate(
            zip(result.request_ids, result.token_ids, strict=True)
        ):
            req = self.requests[request_id]
            req.tokens.append(token_id)
            if logits is not None:
                self.logits[request_id].append(logits[row].clone())
            if len(req.tokens) - req.num_prompt >= req.max_new:
                self.finished.append(request_id)
                self.free.extend(req.blocks)
                del self.requests[request_id]
                self.outputs[request_id] = req.tokens[req.num_prompt :]


def run_plans(planner: TinyPlanner, runners: list[StageRunner], max_steps: int = 1000):
    """Drive every stage in-process until each request has its tokens; returns outputs.

    In async mode stage 0 gets the decode inputs from the last stage's previous result.
    """
    sampled: dict[str, int] = {}
    for _ in range(max_steps):
        if planner.is_done:
            return planner.outputs
        plan = planner.next_plan()
        out = runners[0].execute(plan, input_token_ids=sampled if planner.async_mode else None)
        for runner in runners[1:]:
            out = runner.execute(plan, hidden_in=out)
        sampled = dict(zip(out.request_ids, out.token_ids, strict=True))
        planner.apply(out, runners[-1].last_logits)
    raise AssertionError(f"requests not finished after {max_steps} steps")


@torch.inference_mode()
def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new: int, use_cache: bool = False):
    """Reference: HF forward and argmax, one prompt at a time (no padding), recomputing the
    whole sequence each step or with HF's DynamicCache. Returns (tokens, logits)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    all_tokens, all_logits = [], []
    for prompt in prompts:
        ids, step_logits = list(prompt), []
        cache = transformers.DynamicCache() if use_cache else None
        for _ in range(max_new):
            inputs = ids[-1:] if use_cache and step_logits else ids
            kwargs = {"past_key_values": cache, "use_cache": True} if use_cache else {}
            logits = model(torch.tensor([inputs]), **kwargs).logits[0, -1].float()
            step_logits.append(logits)
            ids.append(int(logits.argmax()))
        all_tokens.append(ids[len(prompt) :])
        all_logits.append(step_logits)
    return all_tokens, all_logits


def compare_greedy(
    ours: list[int], ref: list[int], ref_logits: list[torch.Tensor], tie_margin: float
) -> int:
    """Number of tokens that match; a first mismatch is accepted only at a near-tie of HF's
    top-2 logits (margin < tie_margin), and comparison stops there."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            top2 = ref_logits[i].topk(2).values
            margin = float(top2[0] - top2[1])
            assert margin < tie_margin and a == int(ref_logits[i].topk(2).indices[1]), (
                f"token {i}: ours {a}, HF {b}, HF top-2 margin {margin:.5f} is not a near-tie"
            )
            return i
    return len(ref)


def assert_greedy_matches(
    outcomes, ref_tokens: list[list[int]], ref_logits, num_new: int, tie_margin: float
) -> None:
    """Every outcome has `num_new` tokens equal to HF's greedy ones; a flip is accepted only
    at a near-tie of HF's own top-2 logits (compare_greedy checks), and at most two."""
    flips = []
    for i, outcome in enumerate(outcomes):
        assert len(outcome.token_ids) == num_new
        matched = compare_greedy(outcome.token_ids, ref_tokens[i], ref_logits[i], tie_margin)
        if matched < num_new:
            flips.append((i, matched))
    assert len(flips) <= 2, f"too many near-tie flips: {flips}"


def make_fp8_checkpoint(src_dir: Path, out_dir: Path, per_channel: bool = True) -> Path:
    """Write `src_dir`'s model as llm-compressor / vLLM store FP8: each decoder linear's
    weight in float8_e4m3fn beside a float32 `weight_scale` ([N, 1] per channel, or a
    scalar per tensor) and an `input_scale` Conveyor ignores; the rest as it was."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(Path(src_dir) / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if ".layers." in name and name.endswith("proj.weight"):
            amax = tensor.abs().amax(dim=1, keepdim=True) if per_channel else tensor.abs().amax()
            scale = (amax / 448.0).float()
            out[name] = (tensor / scale).to(torch.float8_e4m3fn)
            out[name + "_scale"] = scale
            out[name.removesuffix("weight") + "input_scale"] = torch.ones(())
        else:
            out[name] = tensor
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, out_dir / "model.safetensors")
    config = json.loads((Path(src_dir) / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True},
            }
        },
        "ignore": ["lm_head"],
    }
    (out_dir / "config.json").write_text(json.dumps(config))
    for extra in Path(src_dir).glob("tokenizer*"):
        shutil.copy(extra, out_dir / extra.name)
    return out_dir
