"""A Llama-family decoder cut to one pipeline stage (Llama, Mistral, Qwen2).

Stage 0 embeds token ids; every stage runs its own decoder layers over the flattened
mixed batch [T, hidden]; the last stage holds the final norm and lm_head, applied only to
the rows that sample (`compute_logits`).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.common.errors import ConfigError
from services.kernels.metadata import AttentionMetadata
from services.worker.model import cpu_ops
from services.worker.model.config import ModelConfig
from services.worker.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rope
from services.worker.model.packed_linear import PackedLinear, pack_linears
from services.worker.model.stages import StageSpec
from services.worker.model.tensor_parallel import (
    TensorParallel,
    VocabParallelEmbedding,
    single_rank,
)

logger = logging.getLogger(__name__)

AttentionFn = Callable[..., torch.Tensor]
ATTENTION_BACKENDS = {
    "cpu": "services.worker.attention.cpu_backend",
    "torch": "services.worker.attention.torch_backend",
    "triton": "services.worker.attention.triton_backend",
}
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def load_attention_backend(name: str) -> AttentionFn:
    """`paged_attention_forward` of the backend `name` (see ATTENTION_BACKENDS), imported
    lazily; the "cpu" backend's kernel is built here, so a failure shows at startup."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"attention_backend={name!r} is unknown: choose one of {sorted(ATTENTION_BACKENDS)}"
        )
    module = importlib.import_module(ATTENTION_BACKENDS[name])
    if hasattr(module, "load_kernels"):
        module.load_kernels()
    return module.paged_attention_forward


def default_attention_backend(device: str) -> str:
    """triton on CUDA; on CPU the C++ decode kernel when it builds here, else plain torch."""
    if device.startswith("cuda"):
        return "triton"
    from services.worker.attention import cpu_backend

    return "cpu" if cpu_backend.available() else "torch"


class Attention(nn.Module):
    """GQA self-attention over the paged KV cache; q/k/v fused into one projection.

    Tensor parallel: q/k/v hold this rank's heads (columns), o_proj the matching input
    columns, and its partial sums are all-reduced (model/tensor_parallel.py)."""

    def __init__(
        self, config: ModelConfig, attention_fn: AttentionFn, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.tp = tp or single_rank(config)
        self.num_heads, self.num_kv_heads = self.tp.shard.num_heads, self.tp.shard.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.attention_fn = attention_fn
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(
            self.q_size, config.hidden_size, bias=config.o_bias and self.tp.rank == 0
        )
        self.attend: AttentionFn | None = None
        """Fused CPU path (`StageModel.use_fused_cpu_ops`, run by `direct_layer`): the
        backend's attention over the cache, after one C++ pass ropes q and k and writes k,
        v (model/cpu_ops.py)."""

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """cos_sin: [T, 1, D] x 2, one row per token."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(num_tokens, self.num_heads, self.head_dim), *cos_sin)  # [T, Hq, D]
        k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_dim), *cos_sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        out = self.attention_fn(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))  # [T, H]


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP, each with a residual connection."""

    def __init__(
        self, config: ModelConfig, attention_fn: AttentionFn, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, attention_fn, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config, tp)
        self.fused = False
        """On CPU: the residual add and the second norm in one C++ pass (model/cpu_ops.py)."""
        self.direct: Callable | None = None
        """The fused path as one plain function (`direct_layer`), built on first use."""

    def forward(self, x, cos_sin, kv_cache, meta) -> torch.Tensor:  # [T, hidden]
        if self.fused:
            if self.direct is None:
                self.direct = direct_layer(self)
            return self.direct(x, cos_sin, kv_cache, meta)
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


def fuse_layer(layer: DecoderLayer, attend: AttentionFn) -> None:
    """Put one decoder layer on the fused CPU path (`StageModel.use_fused_cpu_ops`)."""
    layer.fused = True
    layer.self_attn.attend = attend
    layer.direct = None


def _linear_function(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    direct = getattr(module, "direct", None)  # PackedLinear, QuantLinear
    return direct() if direct is not None else module.forward


def direct_layer(layer: DecoderLayer) -> Callable:
    """The fused CPU path of one layer (one request: one C++ call per matmul and pass) as a
    plain function, its weights bound once: a decode step of one request calls ~10 kernels
    per layer, and the modules' `__call__`, attribute lookups and dispatch checks around
    them cost ~1 ms per step of SmolLM2 (2-5 % of a one-thread step, docs/performance.md).
    Same operations in the same order as the unfused `DecoderLayer.forward`, the residual
    add and the second norm in one pass; tensor parallel: the partial sums of o_proj and
    down_proj all-reduced. A layer swapped in by a weight update builds its own; the
    attention function is read at each call (benchmarks swap it)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv_proj, o_proj = _linear_function(attn.qkv_proj), _linear_function(attn.o_proj)
    gate_up_proj, down_proj = _linear_function(mlp.gate_up_proj), _linear_function(mlp.down_proj)
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    weight1, eps1, weight2, eps2 = norm1.weight, norm1.eps, norm2.weight, norm2.eps
    num_heads, num_kv_heads, q_size = attn.num_heads, attn.num_kv_heads, attn.q_size
    scale, all_reduce = attn.scale, attn.tp.all_reduce

    def forward(x, cos_sin, kv_cache, meta) -> torch.Tensor:  # [T, hidden]
        k_cache, v_cache = kv_cache
        qkv = qkv_proj(cpu_ops.rms_norm(x, weight1, eps1))
        q = cpu_ops.rope_write_kv(
            qkv,
            *cos_sin,
            meta.positions,
            k_cache,
            v_cache,
            meta.slot_mapping,
            num_heads,
            num_kv_heads,
        )  # [T, Hq, D]
        out = attn.attend(q, k_cache, v_cache, meta, scale).reshape(x.shape[0], q_size)
        x, normed = cpu_ops.add_rms_norm(x, all_reduce(o_proj(out)), weight2, eps2)
        return x + all_reduce(down_proj(cpu_ops.silu_mul(gate_up_proj(normed))))

    return forward


def decode_stack(layers) -> object | None:
    """The layers' fused path (`direct_layer`) for decode-only steps of 1-4 rows as one C++
    call (`cpu_ops.DecodeStack`): the same kernels in the same order, without a return to
    Python, and the GIL, between them. None unless every layer is fused, attends with the CPU
    backend's kernel and runs each matmul on `small_linear`, on one tensor-parallel rank."""
    if not layers:
        return None
    cpu_attend = importlib.import_module(ATTENTION_BACKENDS["cpu"]).attend_cached
    first = layers[0].self_attn
    stack = cpu_ops.load_kernels().DecodeStack(first.num_heads, first.num_kv_heads, first.scale)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not layer.fused or attn.attend is not cpu_attend or attn.tp.size != 1:
            return None
        linears = []
        for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            args = getattr(module, "small_linear_args", lambda: None)()
            if args is None:
                return None
            linears.append(args)
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        stack.add_layer(norm1.weight, norm1.eps, norm2.weight, norm2.eps, linears)
    return stack


class StageModel(nn.Module):
    """The layers of one pipeline stage, plus embedding (first) and norm/lm_head (last)."""

    def __init__(
        self,
        config: ModelConfig,
        stage: StageSpec,
        attention_backend: str = "torch",
        max_positions: int | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.config, self.stage = config, stage
        self.tp = tp or single_rank(config)
        """This rank's shard and the stage's group (one rank: no sharding)."""
        self.attention_backend = attention_backend
        attention_fn = load_attention_backend(attention_backend)
        self.rotary = RotaryEmbedding(config, max_positions or config.max_position_embeddings)
        self.embed_tokens = self._embedding() if stage.is_first else None
        self.layers = nn.ModuleList(
            DecoderLayer(config, attention_fn, self.tp) for _ in range(stage.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else None
        # [V, hidden]; on a single-stage tied model it is the embedding weight itself.
        self.register_buffer("lm_head_weight", None, persistent=False)
        self.lm_head: PackedLinear | None = None
        """The logits matmul in oneDNN's layout, once `use_onednn()` ran (last stage only)."""
        self.fused = False
        """Whether `use_fused_cpu_ops` ran."""
        self.stack_decode = True
        """Decode-only steps of 1-4 rows through `decode_stack` where it applies (False: the
        layer loop; benchmarks compare the two)."""
        self._stack_key: tuple | None = None
        self._stack = None
        """`decode_stack` of `_stack_key`'s layers (`_decode_stack`)."""
        self.quantization = None
        """The layers' weight quantization (model/quant.py `QuantSummary`), None: none."""
        self.requires_grad_(False)

    def _embedding(self) -> nn.Module:
        if self.tp.size == 1:
            return nn.Embedding(self.config.vocab_size, self.config.hidden_size)
        return VocabParallelEmbedding(self.tp, self.config.hidden_size)

    def use_onednn(self, keep_plain: bool = False) -> None:
        """Run every matmul (projections, MLP, logits) through oneDNN with packed weights
        (where oneDNN packs the dtype; else the plain weight: `plain_linear`).

        CPU only, after the weights are loaded; see model/packed_linear.py for why.
        `keep_plain`: matmuls of 1-4 rows on `cpu_ops.small_linear` (model/cpu_ops.py).
        """
        pack_linears(self.layers, keep_plain)
        if self.lm_head_weight is not None:
            self.lm_head = PackedLinear(self.lm_head_weight, keep_plain=keep_plain)
            self.lm_head_weight = None  # the embedding keeps its own weight when tied
        linears = [m for m in self.modules() if isinstance(m, PackedLinear)]
        onednn = sum(m.packed_weight is not None for m in linears)
        amx = sum(m.amx_weight is not None for m in linears)
        logger.info(
            "stage %d: %d matmuls on oneDNN, %d on AMX-BF16 tiles, %d on plain weights",
            self.stage.stage_index,
            onednn,
            amx,
            len(linears) - onednn - amx,
        )

    def use_fused_cpu_ops(self) -> bool:
        """Run each layer's elementwise work as fused C++ passes (model/cpu_ops.py): RMSNorm,
        residual add + RMSNorm, SiLU * up, RoPE + the KV write. A decode step of one request
        dispatches ~40 small ops per layer in eager PyTorch, and that dispatch, not the
        arithmetic, is their cost. CPU, float32 or bfloat16, torch or cpu attention only;
        returns whether it applies (else nothing changes)."""
        dtype = self.layers[0].input_layernorm.weight.dtype if len(self.layers) else None
        if (
            self.attention_backend not in ("cpu", "torch")
            or self.rotary.cos_cache.device.type != "cpu"
            or dtype not in (torch.float32, torch.bfloat16)
            or not cpu_ops.available()
        ):
            return False
        attend = importlib.import_module(ATTENTION_BACKENDS[self.attention_backend]).attend_cached
        for layer in self.layers:
            fuse_layer(layer, attend)
        if self.norm is not None:
            self.norm.fused = True
        self.fused = True
        return True

    def forward(
        self,
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        input_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this stage's layers: token ids [T] (first stage) or hidden [T, hidden] in,
        hidden [T, hidden] out (before the final norm on the last stage)."""
        if self.stage.is_first:
            if input_ids is None:
                raise ValueError("stage 0 needs input_ids")
            x = self.embed_tokens(input_ids)  # [T, hidden]
        else:
            if hidden_states is None:
                raise ValueError(f"stage {self.stage.stage_index} needs hidden_states")
            x = hidden_states
        if self.fused:  # the kernel looks positions up itself
            cos_sin = (self.rotary.cos_cache, self.rotary.sin_cache)  # [P, D] x 2 float32
        else:
            cos_sin = self.rotary.cos_sin(meta.positions, x.dtype)  # [T, 1, D] x 2
        if (
            self.stack_decode
            and self.fused
            and meta.is_decode_only
            and x.shape[0] <= cpu_ops.MAX_ROWS
        ):
            stack = self._decode_stack(kv_caches)
            if stack is not None:
                return stack.forward(
                    x,
                    *cos_sin,
                    meta.positions,
                    meta.slot_mapping,
                    [k for k, _ in kv_caches],
                    [v for _, v in kv_caches],
                    meta.block_tables,
                    meta.seq_lens,
                )
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, kv_cache, meta)
        return x

    def forget_decode_stack(self) -> None:
        """Drops the stack and the layers it was built of (a weight update swapped layers
        out: their memory goes now, not at the next step that asks for a stack)."""
        self._stack_key, self._stack = None, None

    def _decode_stack(self, kv_caches: KVCaches):
        """`decode_stack` of the layers as they are now (a weight update swaps layers in,
        benchmarks swap attention functions), or None (also for caches it cannot read).
        Built again when a layer, its `fused` or its attention function changes; a matmul's
        `small_batch` turned off alone (a benchmark's knob) is not seen."""
        if len(kv_caches) != len(self.layers) or not kv_caches:
            return None
        if kv_caches[0][0].dtype not in (torch.float32, torch.bfloat16):
            return None
        key = tuple((layer, layer.fused, layer.self_attn.attend) for layer in self.layers)
        if key != self._stack_key:
            self._stack_key, self._stack = key, decode_stack(self.layers)
        return self._stack

    def compute_logits(
        self, hidden_states: torch.Tensor, float32: bool = True
    ) -> torch.Tensor | None:
        """[N, hidden] rows that sample -> [N, vocab] float32 logits (last stage only); in
        the model's dtype with `float32` False (what a greedy argmax needs: widening is
        exact, so it changes no maximum; 64 rows of SmolLM2 took ~0.9 ms to widen).

        Tensor parallel: each rank computes its vocabulary range and rank 0 gathers the
        whole rows; the other ranks get None (they receive rank 0's sampled tokens)."""
        if self.norm is None:
            raise ValueError(f"stage {self.stage.stage_index} is not the last stage")
        hidden_states = self.norm(hidden_states)
        if self.lm_head is not None:
            logits = self.lm_head(hidden_states)
        else:
            logits = F.linear(hidden_states, self.lm_head_weight)
        if float32:
            logits = logits.float()
        return self.tp.gather_last_dim(logits)  # [N, V/tp] per rank -> [N, V] on rank 0
