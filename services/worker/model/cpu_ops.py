"""C++ CPU kernels for decode steps of a few rows: `small_linear` (csrc/cpu_ops.cpp).

A decode step of one or two requests reads every weight once and does 2 flops per weight
read: it is bound by memory bandwidth, and by how close the matmul kernel streams at it.
oneDNN's packed GEMM and torch's int8 weight-only kernel are tiled for many rows; at one
row they read the weights at a fraction of the bandwidth a plain streaming dot product
reaches (docs/performance.md, "One request"). `small_linear` is that dot product: each
thread streams whole rows of the plain [N, K] weight (float32, bfloat16 or int8 with a
per-channel scale), widened to float32 in registers.

Built once per machine like the attention kernel (attention/cpu_backend.py), with AVX-512
where torch reports it (int8 -> float32 widening is the inner loop's cost there), into
$TORCH_EXTENSIONS_DIR/conveyor-<torch version>/.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from services.common.errors import ConfigError
from services.worker.cpp_build import build_extension

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
MAX_ROWS = 4
"""Rows up to which `small_linear` serves a matmul (the C++ kernel's kMaxRows): from ~4
rows on, oneDNN's register tiling pays more than streaming saves (measured, same page)."""
AMX_BF16_MAX_ROWS = 512
"""Rows up to which `small_linear` serves a bfloat16 matmul given `bf16_pack_amx`'s copy (the
C++ kernel's kAmxBf16MaxRows: the CPU's default 512-token steps); oneDNN beyond (its tiling
for long prefills wins there, docs/performance.md)."""
_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


def _arch() -> tuple[str, list[str]]:
    """(name, vector flags): AVX-512 only where torch itself runs AVX-512 kernels."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return "avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
    if capability.startswith("AVX2"):
        return "avx2", ["-mavx2", "-mfma"]
    return "generic", []


@functools.cache
def load_kernels():
    """The compiled extension (built on first use); ConfigError when it cannot build."""
    arch, arch_flags = _arch()
    return build_extension(f"conveyor_cpu_ops_{arch}", SOURCE, arch_flags, "CPU matmul kernel")


@functools.cache
def available() -> bool:
    """Whether the kernel builds (or is already built) here; warns once when it does not."""
    try:
        load_kernels()
    except ConfigError as exc:
        logger.warning("%s; small-batch matmuls stay on oneDNN/torch", exc)
        return False
    return True


def serves(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether `small_linear(x, weight)` applies: a CPU matmul of 1..MAX_ROWS rows, or of
    any number of rows for int8 weights (exact integer dots: a row's result depends neither
    on the batch around it nor on the CPU's instruction set)."""
    return (
        weight is not None
        and x.dim() == 2
        and x.device.type == "cpu"
        and weight.dtype in _DTYPES
        and available()
        and x.shape[0] >= 1
        and (x.shape[0] <= MAX_ROWS or weight.dtype == torch.int8)
    )


def small_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (* scale [N]) (+ bias [N]) -> [M, N] in x's dtype.

    Float32 and bfloat16 weights: computed in float32, M <= MAX_ROWS (bfloat16 x and
    weights on AVX512-BF16's dot where the CPU has it); with `packed`
    (`bf16_pack_amx(weight)`) bfloat16 ones up to AMX_BF16_MAX_ROWS rows on AMX tiles, each
    row's result the same in any batch of MAX_ROWS + 1 rows and more. int8 weights: any M,
    activations rounded to int16 per row, exact integer dots (bit-identical for every batch
    size and instruction set); `packed` (`int8_pack_amx(weight)`) lets batches of 4 rows
    and more run them on AMX.
    """
    return load_kernels().small_linear(x, weight, scale, bias, packed)  # casts in C++


def int8_pack_amx(weight: torch.Tensor) -> torch.Tensor | None:
    """The copy of int8 weights [N, K] that `small_linear`'s AMX path reads (as many bytes,
    N padded to 32 and K to 64), or None where the CPU has no AMX-INT8 (or no kernel)."""
    if weight.device.type != "cpu" or not available():
        return None
    return load_kernels().int8_pack_amx(weight)


def bf16_pack_amx(weight: torch.Tensor) -> torch.Tensor | None:
    """The copy of bfloat16 weights [N, K] that `small_linear`'s AMX-BF16 path reads (as
    many bytes, N and K padded to 32), for matmuls of MAX_ROWS + 1 to AMX_BF16_MAX_ROWS rows;
    None where the CPU has no AMX-BF16 (or no kernel)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not available():
        return None
    return load_kernels().bf16_pack_amx(weight)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum of float32 or bfloat16 logits [N, V] (a NaN the largest,
    as torch's argmax): [N] int64."""
    return load_kernels().argmax_rows(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, hidden] (float32 or bfloat16) in one pass; HF's operation order."""
    return load_kernels().rms_norm(x.contiguous(), weight, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)) in one pass: the residual add before a norm."""
    return load_kernels().add_rms_norm(x.contiguous(), delta.contiguous(), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused [T, 2I] gate/up projection -> [T, I]."""
    return load_kernels().silu_mul(gate_up.contiguous())


def rope_write_kv(
    qkv: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """From the fused projection qkv [T, (Hq + 2 Hkv) * D]: q and k rotated by RoPE at
    `positions` (float32 tables [P, D]), k and v written to the paged caches at
    `slot_mapping`; returns q [T, Hq, D]."""
    return load_kernels().rope_write_kv(
        qkv.contiguous(),
        cos_table,
        sin_table,
        positions,
        k_cache,
        v_cache,
        slot_mapping,
        num_heads,
        num_kv_heads,
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The CPU decode attention (attention/cpu_backend.py) over float32 or bfloat16 KV
    caches: q [B, Hq, D] -> [B, Hq, D] in q's dtype, softmax and accumulation in float32 (a
    bfloat16 q is widened and the output rounded in the kernel, as torch's casts would)."""
    native = q.dtype in (torch.float32, torch.bfloat16)
    out = load_kernels().decode_attention(
        (q if native else q.to(torch.float32)).contiguous(),
        k_cache,
        v_cache,
        block_tables.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        scale,
    )
    return out if native else out.to(q.dtype)
