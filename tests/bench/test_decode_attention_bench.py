"""`python -m services.bench.decode_attention`: the attention of a step, alone, runs and
reports every case (its figures come from the benchmark, not from here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.worker.model import cpu_ops


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ kernel does not build here")
def test_decode_attention_bench_reports_each_dtype_and_block_order():
    out = subprocess.run(
        [sys.executable, "-m", "services.bench.decode_attention", "--batch", "3",
         "--context", "40", "--rounds", "1"],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout  # fmt: skip
    rows = [line.split() for line in out.splitlines() if "this checkout" in line]
    assert [row[:2] for row in rows] == [
        ["float32", "random"], ["float32", "contiguous"],
        ["bfloat16", "random"], ["bfloat16", "contiguous"],
    ]  # fmt: skip
    assert all("x 1.00" in line for line in out.splitlines() if "this checkout" in line)
