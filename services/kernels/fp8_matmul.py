"""Weight-only FP8 matmul: out = x @ (weight * scale).T with weight in float8_e4m3fn and one
scale per output channel (services/worker/model/quant.py writes them).

Each program computes a [BLOCK_M, BLOCK_N] tile of the output; it streams [BLOCK_K, BLOCK_N]
tiles of the FP8 weight (one byte per value: half the bytes of bf16, which is what a decode
step is bound by), widens them to x's dtype in registers, and accumulates x-tile @ w-tile in
fp32 on the tensor cores. The per-channel scale multiplies the fp32 accumulator once, at the
end (it is constant along K):

    out[m, n] = scale[n] * sum_k x[m, k] * w[n, k]

Reference: `services.kernels.reference.fp8_linear_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels._checks import check_device, check_tensor, is_interpreted

FP8_DTYPES = (torch.float8_e4m3fn,)


@triton.jit
def _fp8_matmul_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    scale_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k + k0 < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        w = w.to(tl.float32)  # exact; fp8 -> fp32 -> bf16 is how the GPU widens it anyway
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)  # [BN] float32
    acc = acc * scale[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _blocks(num_rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): decode (a few rows) takes the smallest M tile tl.dot
    allows and narrow N tiles, so that enough programs stream the weight; prefill takes
    square-ish tiles that reuse each weight tile over more rows."""
    if num_rows <= 16:
        return 16, 64, 128
    if num_rows <= 64:
        return 64, 64, 64
    return 128, 128, 64


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[T, K] x (fp16, bf16 or fp32), [N, K] float8_e4m3fn weight, [N] float32 scale ->
    [T, N] in x's dtype. x and weight must be contiguous in their last dim."""
    check_tensor("x", x, ndim=2)
    num_rows, in_features = x.shape
    check_tensor("weight", weight, ndim=2, dtypes=FP8_DTYPES, shape=(None, in_features))
    out_features = weight.shape[0]
    check_tensor("scale", scale, ndim=1, dtypes=(torch.float32,), shape=(out_features,))
    for name, tensor in (("x", x), ("weight", weight)):
        if tensor.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got {tensor.stride()}")
    check_device(_fp8_matmul_kernel, ["x", "weight", "scale"], [x, weight, scale])
    out = x.new_empty((num_rows, out_features))
    if num_rows == 0:
        return out
    block_m, block_n, block_k = _blocks(num_rows)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n))
    _fp8_matmul_kernel[grid](
        out,
        x,
        weight,
        scale,
        num_rows,
        out_features,
        in_features,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        # fp32 x: exact products; the interpreter's bf16/fp16 tl.dot is wrong, so it
        # takes the fp32 dot too (as paged_attention does).
        DOT_FP32=x.dtype == torch.float32 or is_interpreted(_fp8_matmul_kernel),
    )
    return out
