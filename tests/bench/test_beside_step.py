"""`python -m services.bench.beside_step`: a decode step alone and beside Python work in
another thread or process runs and reports both (its figures come from the benchmark, not
from here)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from services.worker.model import cpu_ops


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize("where", ["thread", "process"])
def test_beside_step_reports_a_step_alone_and_beside_the_work(where):
    out = subprocess.run(
        [sys.executable, "-m", "services.bench.beside_step", "--rounds", "1", "--context", "40",
         "--work-us", "200", "--in", where],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout  # fmt: skip
    match = re.search(rf"alone ([\d.]+), beside 200 us of Python in another {where} ([\d.]+)", out)
    assert match, out
    assert float(match[1]) > 0 and float(match[2]) > 0
