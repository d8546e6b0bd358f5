"""SwiGLU activation of the Llama MLP: silu(gate) * up from the fused gate_up projection.

Reference: `services.kernels.reference.silu_and_mul_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels._checks import check_device, check_tensor, next_power_of_2


@triton.jit
def _silu_and_mul_kernel(
    out_ptr, x_ptr, stride_ot, stride_xt, INTER: tl.constexpr, BLOCK: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + t * stride_ot + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(x[:, :I]) * x[:, I:], computed in fp32, returned in x's dtype.

    x's last dim must be contiguous.
    """
    check_tensor("x", x, ndim=2)
    num_tokens, width = x.shape
    if width % 2:
        raise ValueError(f"x's last dim must be even (gate and up halves), got {width}")
    if x.stride(1) != 1:
        raise ValueError(f"x must be contiguous in its last dim, got strides {x.stride()}")
    check_device(_silu_and_mul_kernel, ["x"], [x])
    inter = width // 2
    out = x.new_empty((num_tokens, inter))
    block = min(1024, next_power_of_2(inter))
    if num_tokens > 0:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            out, x, out.stride(0), x.stride(0), INTER=inter, BLOCK=block
        )
    return out
