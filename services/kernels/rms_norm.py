"""RMSNorm with an optional fused residual add, rounding like Hugging Face's LlamaRMSNorm.

    residual' = x + residual                   (rounded to x's dtype, as the model adds)
    normed    = weight * to_dtype(residual' * rsqrt(mean(residual'^2) + eps))   (fp32 inside)

Reference: `services.kernels.reference.rms_norm_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels._checks import check_device, check_same_dtype, check_tensor, next_power_of_2


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    stride_ot,
    stride_rot,
    stride_xt,
    stride_rt,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0)  # [H]
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + t * stride_rt + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + t * stride_rot + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / HIDDEN
    normed = (xf * tl.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + t * stride_ot + offs, out, mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row, after adding `residual` when given. Inputs are not modified.

    Args:
        x: [T, H] hidden states (fp16, bf16, fp32), last dim contiguous.
        weight: [H], same dtype as x.
        eps: added to the mean square.
        residual: optional [T, H] of x's dtype, added to x before the norm.
    Returns:
        normed [T, H]; with residual, (normed, x + residual) - the latter is the next
        layer's residual.
    """
    check_tensor("x", x, ndim=2)
    num_tokens, hidden = x.shape
    check_tensor("weight", weight, ndim=1, shape=(hidden,))
    tensors, names = [x, weight], ["x", "weight"]
    if residual is not None:
        check_tensor("residual", residual, ndim=2, shape=(num_tokens, hidden))
        tensors.append(residual)
        names.append("residual")
    check_same_dtype(names, tensors)
    check_device(_rms_norm_kernel, names, tensors)
    for name, tensor in zip(names, tensors, strict=True):
        if tensor.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last dim, got strides {tensor.stride()}"
            )
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(out) if residual is not None else out
    if num_tokens > 0:
        _rms_norm_kernel[(num_tokens,)](
            out,
            residual_out,
            x,
            residual if residual is not None else x,
            weight,
            out.stride(0),
            residual_out.stride(0),
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            eps,
            HIDDEN=hidden,
            BLOCK_H=next_power_of_2(hidden),
            HAS_RESIDUAL=residual is not None,
        )
    return out if residual is None else (out, residual_out)
