"""Argument checks shared by the kernel launchers: one clear ValueError per mistake.

Every launcher validates before it launches, because a Triton kernel given a wrong shape
or dtype does not fail: it reads or writes the wrong memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Activation dtypes every kernel accepts; math is done in fp32 inside the kernels."""


def check_tensor(
    name: str,
    tensor: object,
    *,
    ndim: int,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    shape: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """Raises ValueError unless `tensor` is a torch.Tensor of `ndim` dims, one of `dtypes`,
    and (where `shape` gives a size, None meaning any) of that shape."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be one of ({allowed}), got {tensor.dtype}")
    if shape is not None:
        for dim, (got, want) in enumerate(zip(tensor.shape, shape, strict=True)):
            if want is not None and got != want:
                raise ValueError(
                    f"{name} has size {got} in dim {dim}, expected {want} "
                    f"(shape {tuple(tensor.shape)})"
                )
    return tensor


def check_same_dtype(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Raises ValueError unless every tensor has the dtype of the first."""
    first = tensors[0].dtype
    for name, tensor in zip(names[1:], tensors[1:], strict=True):
        if tensor.dtype != first:
            raise ValueError(f"{name} has dtype {tensor.dtype}, expected {first} like {names[0]}")


def check_device(kernel: object, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Raises ValueError unless all tensors share one device that `kernel` can run on.

    A compiled kernel needs CUDA tensors; a kernel defined while TRITON_INTERPRET=1 was set
    (Triton's interpreter) runs on CPU tensors.
    """
    device = tensors[0].device
    for name, tensor in zip(names, tensors, strict=True):
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, expected {device} like {names[0]}")
    if device.type != "cuda" and not is_interpreted(kernel):
        raise ValueError(
            f"{names[0]} is on {device}: Triton kernels need CUDA tensors "
            "(or TRITON_INTERPRET=1 set before `kernels` is imported, to run on CPU)"
        )


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` was defined under Triton's interpreter (TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (>= 1)."""
    return triton.next_power_of_2(max(int(n), 1))
