"""OpenVINO GenAI as a peer: the model exported to OpenVINO IR once (optimum-intel), then
Conveyor's own prompts (token ids) through its in-process `ContinuousBatchingPipeline`.

Its CPU defaults are bf16 inference and a u8 KV cache; the comparison sets both inference
and KV precision to the dtype Conveyor runs (f32, or bf16 with `--dtype bfloat16`). The IR
keeps fp32 weights either way (`--weight-format fp32`): the precision hint decides the
compute. optimum-intel 2.2's export needs transformers < 5.6.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from services.bench.datasets import BenchRequest
from services.bench.peers.venv import PeerSpec, PeerVenv
from services.common.process import bound_to_parent, child_env

logger = logging.getLogger(__name__)

SPEC = PeerSpec(
    "openvino",
    (
        "openvino==2026.4.1",
        "openvino-genai==2026.4.1.0",
        "openvino-tokenizers==2026.4.1.0",
        "optimum-intel[openvino]==2.2.0",
        "transformers<5.6",
    ),
)
PRECISIONS = {"float32": "f32", "bfloat16": "bf16"}
ROOT = Path(__file__).resolve().parents[3]
EXPORTED = ".conveyor-exported"


@dataclass(frozen=True, slots=True)
class OpenVinoRun:
    venv: PeerVenv
    model_dir: Path
    dtype: str  # float32 | bfloat16
    threads: int
    kv_cache_gib: int
    results_dir: Path

    @property
    def ir_dir(self) -> Path:
        """The exported IR, cached beside the venv (one per source model)."""
        return self.venv.root.parent / "openvino-models" / self.model_dir.name


def export_argv(run: OpenVinoRun) -> list[str]:
    return [
        str(run.venv.bin("optimum-cli")),
        "export",
        "openvino",
        "--model",
        str(run.model_dir),
        "--task",
        "text-generation-with-past",
        "--weight-format",
        "fp32",
        str(run.ir_dir),
    ]


def runner_argv(run: OpenVinoRun, requests_path: Path, out_path: Path) -> list[str]:
    return [
        str(run.venv.python),
        "-m",
        "services.bench.peers.ov_runner",
        "--model",
        str(run.ir_dir),
        "--requests",
        str(requests_path),
        "--out",
        str(out_path),
        "--precision",
        PRECISIONS[run.dtype],
        "--threads",
        str(run.threads),
        "--cache-gib",
        str(run.kv_cache_gib),
    ]


def parse_result(saved: dict) -> dict:
    """The runner's JSON, checked."""
    missing = [k for k in ("output_throughput", "single_request_tpot_ms") if k not in saved]
    if missing:
        raise ValueError(f"not an OpenVINO runner result: no {', '.join(missing)}")
    return dict(saved)


def _peer_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PYTHONPATH"] = str(ROOT)  # for services.bench.peers.ov_runner (stdlib-only imports)
    return env


def ensure_exported(run: OpenVinoRun) -> Path:
    """Exports the model to IR unless done before (log: openvino-export.log)."""
    if (run.ir_dir / EXPORTED).exists():
        return run.ir_dir
    log_path = run.venv.root.parent / "openvino-export.log"
    print(f"--- exporting {run.model_dir} to OpenVINO IR (log: {log_path})", flush=True)
    with log_path.open("w") as log:
        done = subprocess.run(
            bound_to_parent(export_argv(run)),
            env=child_env(_peer_env()),
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"optimum-cli export openvino failed ({done.returncode}): {log_path}")
    (run.ir_dir / EXPORTED).write_text(str(run.model_dir) + "\n")
    return run.ir_dir


def run_openvino(run: OpenVinoRun, requests: list[BenchRequest]) -> dict:
    """Exports once, then runs `ov_runner` in the peer's venv on `requests`."""
    ensure_exported(run)
    requests_path = run.results_dir / "openvino-requests.json"
    out_path = run.results_dir / "openvino-result.json"
    requests_path.write_text(
        json.dumps([{"prompt_ids": r.prompt_ids, "output_len": r.output_len} for r in requests])
    )
    out_path.unlink(missing_ok=True)
    log_path = run.results_dir / "openvino-run.log"
    with log_path.open("w") as log:
        done = subprocess.run(
            bound_to_parent(runner_argv(run, requests_path, out_path)),
            env=child_env(_peer_env()),
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(
            f"the OpenVINO runner failed ({done.returncode}); the end of {log_path}:\n"
            + log_path.read_text()[-3000:]
        )
    return parse_result(json.loads(out_path.read_text()))
