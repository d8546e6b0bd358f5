"""CPU matmuls through oneDNN, with each weight reordered once into oneDNN's blocked layout.

On CPU, `F.linear` calls MKL's sgemm, which takes its AVX2 path on AMD processors. oneDNN
(bundled with every x86 torch build) runs AVX-512 where the CPU has it, and a weight packed
once at load time (`_reorder_linear_weight`) is not re-laid-out on every call. On the
project's 2-core EPYC, one thread (`python -m services.bench.worker_step`):

    rows x (in -> out)        F.linear   oneDNN packed
    32 x (576 -> 3072)          99 GF/s      231 GF/s
    2048 x (576 -> 3072)       101 GF/s      247 GF/s
    1 x (576 -> 49152) logits    8 GF/s       21 GF/s

These are the same kernels torch.compile's CPU freezing pass emits (`mkldnn._linear_pointwise`).
The packed weight replaces the plain one, unless `keep_plain`: then the plain weight stays
beside it for `cpu_ops.small_linear`, which serves the matmuls of 1-4 rows (a decode step of
one or a few requests) closer to the memory bandwidth than oneDNN (model/cpu_ops.py); the
weights then take twice their memory.

On CPUs with AMX-BF16 (Sapphire Rapids on), a bfloat16 `PackedLinear` with `keep_plain`
holds `cpu_ops.bf16_pack_amx`'s copy instead of oneDNN's: matmuls of 5 to 512 rows (decode
batches, the CPU's default 512-token prefill steps) run on the C++ kernel's AMX tiles, in
0.85-0.9x the decode step's time of oneDNN's packed GEMM, and longer ones on torch's matmul
over the plain weight (oneDNN without the repacking, as fast there); still two copies.

Where oneDNN cannot pack the dtype (bfloat16 on a CPU without AVX-512: `onednn_supported`),
a `PackedLinear` keeps the plain weight only: `small_linear` serves 1-4 rows and
`plain_linear` the rest (bfloat16 widened to float32). Before, such a stage ran every matmul through `F.linear` (on an AVX2 EPYC a
one-request bfloat16 decode step read its weights at ~7 GB/s there: docs/performance.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.model import cpu_ops

logger = logging.getLogger(__name__)


_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def onednn_supported(device: str | torch.device, dtype: torch.dtype) -> bool:
    """True when oneDNN packed matmuls can serve this device and dtype.

    oneDNN packs bfloat16 weights only on CPUs with AVX512-BW/VL/DQ or AVX-NE-CONVERT;
    elsewhere (AVX2-only) `_reorder_linear_weight` raises, so bf16 stays on torch.
    """
    return (
        torch.device(device).type == "cpu"
        and dtype in _ONEDNN_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


_UPCAST_CHUNK_BYTES = 2 << 20
"""float32 bytes of weight rows widened at a time by `plain_linear` (they stay in cache)."""


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` over a weight oneDNN cannot pack. bfloat16 is computed in float32, the
    weight widened a block of rows at a time: without AVX-512 torch's bfloat16 matmul is
    3-5x slower than float32's (64 x 576 -> 3072 on an AVX2 EPYC, 2 threads: 16.0 against
    ~4 ms; docs/performance.md), and a block of widened rows stays in cache where the whole
    widened logits weight (113 MB for SmolLM2) would not."""
    if weight.dtype != torch.bfloat16:
        return torch.nn.functional.linear(x, weight, bias)
    x32, rows = x.float(), max(1, _UPCAST_CHUNK_BYTES // (4 * weight.shape[1]))
    b32 = None if bias is None else bias.float()
    if weight.shape[0] <= rows:
        return torch.nn.functional.linear(x32, weight.float(), b32).to(x.dtype)
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
    for n in range(0, weight.shape[0], rows):
        b = None if b32 is None else b32[n : n + rows]
        out[..., n : n + rows] = torch.nn.functional.linear(x32, weight[n : n + rows].float(), b)
    return out


class PackedLinear(nn.Module):
    """`x @ weight.T + bias` with the weight held in oneDNN's layout (inference only),
    where oneDNN packs its dtype; elsewhere the plain weight, for `plain_linear`.

    With `keep_plain`, matmuls of up to `cpu_ops.MAX_ROWS` rows run on `small_linear` over
    the plain weight kept beside the packed one (`small_batch` turns that off and on)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_plain: bool = False
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().contiguous()
        onednn = onednn_supported(weight.device, weight.dtype)
        self.small_batch = keep_plain and weight.dtype in _ONEDNN_DTYPES and cpu_ops.available()
        amx = cpu_ops.bf16_pack_amx(weight) if self.small_batch else None
        self.register_buffer("amx_weight", amx, persistent=False)
        packed = None
        if onednn and amx is None:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("packed_weight", packed, persistent=False)
        plain = keep_plain or not onednn
        self.register_buffer("weight", weight if plain else None, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        # beyond the kernels' rows: torch's matmul on the plain weight (oneDNN, bf16 on AMX)
        self._unpacked = F.linear if onednn else plain_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.small_batch and cpu_ops.serves(x, self.weight):
            return cpu_ops.small_linear(x, self.weight, bias=self.bias)
        if self.small_batch and self._amx_serves(x):
            return cpu_ops.small_linear(x, self.weight, bias=self.bias, packed=self.amx_weight)
        if self.packed_weight is None:
            return self._unpacked(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def _amx_serves(self, x: torch.Tensor) -> bool:
        """Whether x goes to the AMX-BF16 copy: 2-D bfloat16 CPU rows, up to
        AMX_BF16_MAX_ROWS (the C++ kernel takes nothing else)."""
        return (
            self.amx_weight is not None
            and x.dim() == 2
            and 1 <= x.shape[0] <= cpu_ops.AMX_BF16_MAX_ROWS
            and x.dtype == torch.bfloat16
            and x.device.type == "cpu"
        )

    def small_linear_args(self) -> tuple | None:
        """What `direct` passes `cpu_ops.small_linear` for 1-4 rows, as (weight, scale, bias,
        packed, bias added after), or None where it calls something else (model/llama.py
        `decode_stack`)."""
        if not self.small_batch or self.weight is None:
            return None
        return self.weight, None, self.bias, None, None

    def direct(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`forward` as a plain function of a 2-D CPU x, the tensors bound once: what the
        fused layer loop calls (model/llama.py `direct_layer`), with no module dispatch.
        1-4 rows (MAX_ROWS) on `small_linear` over the plain weight; with an AMX-BF16 copy,
        up to AMX_BF16_MAX_ROWS rows on its tiles and more on the plain weight; else
        oneDNN's packed weight."""
        weight, packed, amx, bias = self.weight, self.packed_weight, self.amx_weight, self.bias
        onednn, unpacked = torch.ops.mkldnn._linear_pointwise, self._unpacked
        small_rows, amx_rows = cpu_ops.MAX_ROWS, cpu_ops.AMX_BF16_MAX_ROWS

        def linear(x: torch.Tensor) -> torch.Tensor:
            if self.small_batch:
                rows = x.shape[0]
                if rows <= small_rows:
                    return cpu_ops.small_linear(x, weight, bias=bias)
                if amx is not None and rows <= amx_rows and x.dtype == torch.bfloat16:
                    return cpu_ops.small_linear(x, weight, bias=bias, packed=amx)
            if packed is None:
                return unpacked(x, weight, bias)
            return onednn(x, packed, bias, "none", [], "")

        return linear

    def extra_repr(self) -> str:
        layout = "plain"
        if self.amx_weight is not None:
            layout = "amx-bf16"
        elif self.packed_weight is not None:
            layout = "onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, {layout}"


def pack_linears(module: nn.Module, keep_plain: bool = False) -> int:
    """Swap every `nn.Linear` under `module` for a `PackedLinear`; returns how many."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias, keep_plain))
                swapped += 1
    return swapped
