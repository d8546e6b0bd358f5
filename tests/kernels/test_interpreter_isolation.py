"""The interpreter harness of conftest.py: kernels interpreted, nothing leaked to other areas."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import services.kernels.paged_attention
from services.kernels._checks import is_interpreted

REPO = Path(__file__).resolve().parents[2]

_AFTER_COMPILED_TRITON = """
import os, sys, runpy
import triton  # another test area imported triton first, in compiled mode
runpy.run_path(sys.argv[1])  # the kernel tests' conftest
assert "TRITON_INTERPRET" not in os.environ, "TRITON_INTERPRET leaked"
os.environ["TRITON_INTERPRET"] = "1"  # what the autouse fixture does during a test
import torch
from services.kernels.rms_norm import rms_norm
from services.kernels.reference import rms_norm_ref
x, w = torch.randn(3, 16), torch.randn(16)
torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
print("ok")
"""


def test_kernels_are_interpreted_during_tests():
    assert is_interpreted(services.kernels.paged_attention._paged_attention_kernel)
    assert os.environ.get("TRITON_INTERPRET") == "1"  # set by the autouse fixture


def test_conftest_reimports_triton_imported_before_in_compiled_mode():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _AFTER_COMPILED_TRITON, str(REPO / "tests/kernels/conftest.py")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
