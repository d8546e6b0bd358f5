"""The "triton" attention backend plugs into the runner: same tokens as the torch backend.

Runs in a child process with TRITON_INTERPRET=1 (Triton's CPU interpreter), so the mode
never leaks into other tests; shapes are tiny because the interpreter is slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.worker.utils import make_tiny_model

SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)
from services.worker.model.loader import load_stage_model
from services.worker.model.stages import stage_spec
from services.worker.kv_cache import KVCache, KVCacheSpec
from services.worker.runner import StageRunner
from tests.worker.utils import TinyPlanner, run_plans
out = {}
for backend in ("torch", "triton"):
    model = load_stage_model(sys.argv[1], stage_spec(2, 1, 0), attention_backend=backend)
    runner = StageRunner(model, KVCache(KVCacheSpec(2, 2, 16, 8, torch.float32), 16))
    planner = TinyPlanner(8, 16, chunk_size=5, shuffle_seed=3)
    planner.add("a", [5, 6, 7, 8, 9, 10, 11], 3)
    planner.add("b", [12, 13, 14], 3, arrival_step=1)
    out[backend] = run_plans(planner, [runner])
print(json.dumps(out))
"""


def test_triton_backend_gives_the_torch_backend_tokens(tmp_path):
    pytest.importorskip("triton")
    model_dir = make_tiny_model(tmp_path / "m", num_kv_heads=2, num_layers=2)
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["triton"] == result["torch"]
    assert all(len(tokens) == 3 for tokens in result["torch"].values())
