"""Runs the Triton kernels on CPU in Triton's interpreter.

Triton picks interpreter or compiler when a `@triton.jit` function is *defined*, so the
kernel modules are imported here with TRITON_INTERPRET=1 and the variable is then put back
as it was: other test areas (and the worker processes they start) never see it, and the
kernels stay interpreted because they were defined that way.
"""

from __future__ import annotations

import importlib
import os
import sys

_KERNEL_MODULES = (
    "kernels.paged_attention",
    "kernels.reshape_and_cache",
    "kernels.rms_norm",
    "kernels.rotary_embedding",
    "kernels.silu_and_mul",
    "services.worker.attention.triton_backend",
)


def _import_interpreted() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in _KERNEL_MODULES:
            # A module imported earlier in this process (compiled mode) is re-defined.
            if name in sys.modules:
                importlib.reload(sys.modules[name])
            else:
                importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


_import_interpreted()
