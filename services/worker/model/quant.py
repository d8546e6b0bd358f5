"""Weight-only quantization of a stage's linears: int8 or FP8, one scale per output channel.

Each worker quantizes only its own layers, after they are loaded in the compute dtype
(`quantize_linears`); embeddings, norms and the logits matmul stay in the compute dtype, and
so do the projections named in `--quantization-ignore` (by default fp8 keeps down_proj:
see `default_ignore`). A weight row r is stored as q[r, :] with  w[r, :] ~= q[r, :] * scale[r]:

    int8:  scale = amax(|w[r]|) / 127     q = round(w / scale) in [-127, 127]
    fp8:   scale = amax(|w[r]|) / 448     q = float8_e4m3fn(w / scale)   (448: e4m3's max)

Matmuls (`QuantLinear.forward`), by what the hardware has:

    int8, CPU   the C++ kernel `cpu_ops.small_linear` for every batch size: activations
                rounded to int16 per row, exact integer dots (AMX from 4 rows on where the
                CPU has it, over a copy of q repacked at load; AVX512-VNNI, AVX2 or scalar
                otherwise: the same bits); torch's `_weight_int8pack_mm` (bf16 activations)
                only where the C++ kernel cannot build
    fp8, CUDA   the Triton kernel kernels/fp8_matmul.py (fp8 tiles widened in registers)
    otherwise   dequantized in the matmul: x @ (q * 1).T, then * scale per column

FP8 checkpoints (vLLM / llm-compressor: `*.weight` in float8_e4m3fn beside `weight_scale`,
per tensor or per channel) are read through `Fp8CheckpointReader`, which hands the loader
the exact float32 product q * weight_scale; quantizing that per channel again gives back the
stored values wherever the checkpoint's scales are per channel.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from services.common.errors import ConfigError, ModelLoadError
from services.worker.model import cpu_ops
from services.worker.model.loader import SafetensorsReader, load_stage_model, resolve_dtype

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "fp8")
"""`--quantization`: vLLM's names for the weight formats."""
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""The decoder layer's linears, by the names `--quantization-ignore` takes."""
INT8_MAX = 127.0
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
FP8_DTYPES = (torch.float8_e4m3fn,)


@dataclass(slots=True, frozen=True)
class QuantSummary:
    """What `quantize_linears` did to one stage: for Describe, metrics and logs."""

    method: str | None
    """"int8", "fp8", or None (nothing quantized)."""
    num_linears: int
    """Linear layers whose weights are quantized."""
    weight_bytes: int
    """Bytes of the quantized weights and their scales."""
    full_bytes: int
    """Bytes those weights took in the compute dtype before quantization."""
    ignored: tuple[str, ...] = ()
    """Projections kept in the compute dtype (`--quantization-ignore`)."""


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] int8, scale [N] float32), symmetric per output channel.

    The scale is rounded to a bfloat16 value (the CPU kernel takes bf16 scales) before q is
    computed, so q * scale is the exact dequantized weight in every dtype; rounding it up
    by one part in 256 keeps every |w / scale| <= 127.
    """
    amax = weight.detach().float().abs().amax(dim=1).clamp(min=1e-12)  # [N]
    scale = (amax / INT8_MAX * (1 + 2**-8)).to(torch.bfloat16).float()
    q = torch.round(weight.float() / scale[:, None]).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8).contiguous(), scale


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] float8_e4m3fn, scale [N] float32), per output channel."""
    amax = weight.detach().float().abs().amax(dim=1).clamp(min=1e-12)  # [N]
    scale = amax / FP8_MAX
    q = (weight.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn).contiguous(), scale


QUANTIZERS = {"int8": quantize_int8, "fp8": quantize_fp8}


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q [N, K], scale [N]) -> the [N, K] weight q * scale in `dtype` (computed in fp32)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


class QuantLinear(nn.Module):
    """`x @ dequantize(q, scale).T + bias` with q held in int8 or float8_e4m3fn."""

    def __init__(self, method: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.method = method
        self.out_features, self.in_features = weight.shape
        q, scale = QUANTIZERS[method](weight)
        self.register_buffer("qweight", q, persistent=False)  # [N, K]
        self.register_buffer("scale", scale, persistent=False)  # [N] float32
        # The int8 CPU kernel wants scales in the activation dtype: exact, see quantize_int8.
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        # int8 on a CPU with AMX-INT8: a second copy of q in AMX's tile layout, for batches
        # of 4 rows on (as many bytes again as q; None elsewhere).
        packed = cpu_ops.int8_pack_amx(q) if method == "int8" else None
        self.register_buffer("qweight_amx", packed, persistent=False)

    @property
    def num_bytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * 4

    small_batch = True
    """int8 on CPU: every matmul on `cpu_ops.small_linear`'s exact integer dot, so a row's
    result does not depend on the batch around it (sync and async scheduling batch
    differently); torch's int8 kernel only where the C++ kernel cannot build. False: torch's
    kernel always (quant_compare measures the two)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.method == "int8" and self.small_batch and cpu_ops.serves(x, self.qweight):
            out = cpu_ops.small_linear(x, self.qweight, self.scale, packed=self.qweight_amx)
        elif self.method == "int8" and x.device.type == "cpu":
            out = torch.ops.aten._weight_int8pack_mm(
                x.to(torch.bfloat16), self.qweight, self.scale_bf16
            ).to(x.dtype)
        elif self.method == "fp8" and x.device.type == "cuda":
            from services.kernels.fp8_matmul import fp8_linear

            out = fp8_linear(x, self.qweight, self.scale)
        else:
            out = _dequantized_linear(x, self.qweight, self.scale)
        return out if self.bias is None else out + self.bias

    def small_linear_args(self) -> tuple | None:
        """What `direct` passes `cpu_ops.small_linear` for a few rows, as (weight, scale,
        bias, packed, bias added after), or None where it calls something else (model/llama.py
        `decode_stack`)."""
        if self.method != "int8" or not self.small_batch or not cpu_ops.available():
            return None
        return self.qweight, self.scale, None, self.qweight_amx, self.bias

    def direct(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`forward` as a plain function of a 2-D CPU x, the tensors bound once: what the
        fused layer loop calls (model/llama.py `direct_layer`), with no module dispatch."""
        if self.method != "int8" or not cpu_ops.available():
            return self.forward
        qweight, scale, packed, bias = self.qweight, self.scale, self.qweight_amx, self.bias

        def linear(x: torch.Tensor) -> torch.Tensor:
            if not self.small_batch:
                return self.forward(x)
            out = cpu_ops.small_linear(x, qweight, scale, packed=packed)
            return out if bias is None else out + bias

        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.method}"


def _dequantized_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Where no kernel computes on q: widen it, multiply, scale the output columns.

    On CPU the widening and matmul run in float32: bf16 matmuls without AVX512-BF16 are
    several times slower than MKL's fp32 ones, and fp8 -> fp32 is the cheapest cast.
    """
    compute = torch.float32 if x.device.type == "cpu" else x.dtype
    out = F.linear(x.to(compute), q.to(compute)) * scale.to(compute)
    return out.to(x.dtype)


def default_ignore(method: str) -> tuple[str, ...]:
    """The projections `method` keeps in the compute dtype unless told otherwise.

    fp8 keeps down_proj: e4m3's 3 mantissa bits give every weight ~2.6% rms relative error
    (int8 per channel: ~1%), and down_proj's inputs carry the model's massive activations
    (up to ~850x their rms in SmolLM2), which multiply the error of the few weights they
    meet; on SmolLM2 FP8 down_proj alone cost as much perplexity as every other projection
    together (docs/performance.md#fp8-which-projections). int8 quantizes everything.
    """
    return ("down_proj",) if method == "fp8" else ()


def quantize_linears(module: nn.Module, method: str, ignore: tuple[str, ...] = ()) -> QuantSummary:
    """Swap every `nn.Linear` under `module` for a `QuantLinear` of `method`, except those
    whose attribute name is in `ignore` (they stay as they are)."""
    if method not in QUANTIZERS:
        raise ConfigError(f"quantization={method!r} is unknown: choose one of {QUANTIZATIONS}")
    num, weight_bytes, full_bytes = 0, 0, 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name not in ignore:
                quantized = QuantLinear(method, child.weight, child.bias)
                full_bytes += child.weight.numel() * child.weight.element_size()
                weight_bytes += quantized.num_bytes
                setattr(parent, name, quantized)
                num += 1
    return QuantSummary(method, num, weight_bytes, full_bytes, tuple(ignore))


def quantize_stage(model: nn.Module, method: str, ignore: tuple[str, ...] = ()) -> QuantSummary:
    """Quantize the decoder layers of a loaded StageModel (embeddings, norms, the logits and
    the `ignore`d projections stay in the compute dtype) and record what was done in
    `model.quantization`."""
    summary = quantize_linears(model.layers, method, ignore)
    model.quantization = summary
    logger.info(
        "stage %d: %d linears quantized to %s (%.1f MiB -> %.1f MiB), kept: %s",
        model.stage.stage_index,
        summary.num_linears,
        method,
        summary.full_bytes / 2**20,
        summary.weight_bytes / 2**20,
        ", ".join(ignore) or "none",
    )
    return summary


def load_quantized_stage(
    model_dir: str | Path,
    stage,
    dtype: str,
    quantization: str | None,
    ignore: tuple[str, ...] | None = None,
    **kwargs,
) -> nn.Module:
    """`load_stage_model`, then quantize the layers: `quantization`, else the checkpoint's
    own (an FP8 checkpoint is read through `Fp8CheckpointReader` either way), keeping the
    projections in `ignore` in `dtype`. `ignore` None: `default_ignore(method)` when
    quantizing at load; nothing for an FP8 checkpoint, whose values are FP8 already (kept
    in bf16 they would only take more bytes)."""
    checkpoint = checkpoint_quantization(model_dir)
    model = load_stage_model(model_dir, stage, dtype, reader=checkpoint_reader(model_dir), **kwargs)
    method = quantization or checkpoint
    if method is not None:
        if ignore is None:
            ignore = () if checkpoint == "fp8" else default_ignore(method)
        quantize_stage(model, method, ignore)
        for layer in model.layers:  # an FP8 checkpoint's kept linears read as float32
            _linears_to(layer, resolve_dtype(dtype))
    return model


def _linears_to(module: nn.Module, dtype: torch.dtype) -> None:
    """The `nn.Linear`s left unquantized under `module`, in `dtype` (QuantLinear's scales
    stay float32, so `module.to(dtype)` would not do)."""
    for child in module.modules():
        if isinstance(child, nn.Linear):
            child.to(dtype)


def checkpoint_reader(model_dir: str | Path) -> SafetensorsReader:
    """The reader of a model directory: `Fp8CheckpointReader` for an FP8 checkpoint."""
    if checkpoint_quantization(model_dir) == "fp8":
        return Fp8CheckpointReader(model_dir)
    return SafetensorsReader(model_dir)


def quantize_like(model: nn.Module, layer: nn.Module, dtype: torch.dtype) -> None:
    """Store a freshly filled decoder `layer` as `model`'s live layers are (weight updates):
    quantized with the model's method, else in `dtype` (an FP8 checkpoint's linears read
    as float32)."""
    if model.quantization is not None:
        quantize_linears(layer, model.quantization.method, model.quantization.ignored)
        _linears_to(layer, dtype)
    else:
        layer.to(dtype)


# ---------------------------------------------------------------- FP8 checkpoints
def checkpoint_quantization(model_dir: str | Path) -> str | None:
    """ "fp8" when config.json declares an FP8 checkpoint (vLLM's `quant_method: fp8`, or
    llm-compressor's compressed-tensors with float 8-bit weights), else None."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # ModelConfig.from_dir reports a bad config.json
    quant = config.get("quantization_config") or config.get("compression_config")
    if not isinstance(quant, dict):
        return None
    method = quant.get("quant_method")
    if method == "fp8":
        return "fp8"
    if method == "compressed-tensors":
        for group in (quant.get("config_groups") or {}).values():
            weights = (group or {}).get("weights") or {}
            if weights.get("type") == "float" and weights.get("num_bits") == 8:
                return "fp8"
    raise ModelLoadError(
        f"{model_dir}: quantization_config {method!r} is not supported: Conveyor reads "
        "unquantized and FP8 (weight_scale) checkpoints"
    )


class Fp8CheckpointReader(SafetensorsReader):
    """A reader that turns `<name>.weight` stored in FP8 (+ `<name>.weight_scale`) into the
    float32 weight q * weight_scale; every other tensor reads as usual."""

    def get(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        scale_name = name + "_scale"
        if not (name.endswith(".weight") and self.has(scale_name)):
            return super().get(name, shape, dtype, rows, cols)
        q = super().get(name, shape, torch.float32, rows, cols)  # fp8 -> fp32 is exact
        scale = self._read_scale(scale_name)
        if scale.numel() not in (1, shape[0]):
            raise ModelLoadError(
                f"{self.model_dir}: {scale_name} has {scale.numel()} values; expected 1 (per "
                f"tensor) or {shape[0]} (per output channel)"
            )
        if scale.numel() > 1 and rows is not None:  # a tensor-parallel shard's channels
            scale = scale[rows[0] : rows[1]]
        weight = q * scale[:, None]  # exact in float32: 4-bit mantissas times a scale
        # Decoder linears are quantized per channel next; anything else (an FP8 lm_head)
        # stays in the compute dtype like an unquantized checkpoint's.
        return weight if ".layers." in name else weight.to(dtype)

    def _read_scale(self, name: str) -> torch.Tensor:
        """A scale as a flat float32 tensor, whatever its stored shape ([], [1], [N], [N, 1]:
        a 0-dim tensor cannot be sliced, so it is read whole)."""
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = self._open(path).__enter__()
        self.names_read.append(name)
        return self._handles[path].get_tensor(name).float().reshape(-1)
