"""Runs the Triton kernels on CPU in Triton's interpreter, without leaking that mode.

Triton decides interpreter vs compiler when a `@triton.jit` function is *defined* - its own
standard library (tl.sum, tl.cdiv, ...) included, at `import triton` - and reads the
TRITON_INTERPRET knob again at a few points while running. So:

* at collection, triton and the kernel modules are imported with TRITON_INTERPRET=1 and
  the variable is put back as it was. If another test area imported triton earlier (e.g.
  through transformers), that compiled-mode triton is dropped from sys.modules first and
  imported again; modules that hold the old one keep it, unused on CPU;
* an autouse fixture sets TRITON_INTERPRET=1 only while each kernel test runs, so no other
  test (nor the worker processes they start) sees it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

import pytest

_KERNEL_MODULES = (
    "services.kernels._checks",
    "services.kernels.fp8_matmul",
    "services.kernels.paged_attention",
    "services.kernels.reshape_and_cache",
    "services.kernels.rms_norm",
    "services.kernels.rotary_embedding",
    "services.kernels.silu_and_mul",
    "services.worker.attention.triton_backend",
)


def _is_triton_interpreted() -> bool:
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.sum, InterpretedFunction)


def _is_triton_python_module(name: str) -> bool:
    is_triton = name == "triton" or name.startswith("triton.")
    return is_triton and not name.startswith("triton._C")


def _import_interpreted() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        if "triton" in sys.modules and not _is_triton_interpreted():
            # The compiled extension (triton._C) stays: it cannot be loaded twice.
            for name in [n for n in sys.modules if _is_triton_python_module(n)]:
                del sys.modules[name]
        for name in _KERNEL_MODULES:
            sys.modules.pop(name, None)
        import triton  # noqa: F401

        # Imported lazily at the first launch, and it insists on the interpreter knob.
        with contextlib.suppress(ImportError):
            importlib.import_module("triton.experimental.gluon")
        for name in _KERNEL_MODULES:
            importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


_import_interpreted()


@pytest.fixture(autouse=True)
def _triton_interpret(monkeypatch):
    """Triton reads the knob while running, too: keep it on during each kernel test."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
