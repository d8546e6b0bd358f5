"""WorkerConfig refuses, before loading anything, what could not work or would be ignored."""

import json
import os
import subprocess
import sys

import pytest
import torch

from services.common.errors import ConfigError
from services.common.redis_server import free_port
from services.worker.config import WorkerConfig, parse_layer_split
from services.worker.sim import MODELS_DIR

SIM_MODEL = str(MODELS_DIR / "smollm2-135m")  # config.json only; max_position_embeddings 8192


def test_worker_config_refuses_triton_attention_off_cuda():
    for device in ("cpu", "sim"):
        with pytest.raises(ConfigError, match="--attention-backend triton needs --device cuda"):
            WorkerConfig(SIM_MODEL, device=device, attention_backend="triton")


def test_worker_config_refuses_cpu_attention_off_cpu():
    with pytest.raises(ConfigError, match="--attention-backend cpu needs --device cpu"):
        WorkerConfig(SIM_MODEL, device="sim", attention_backend="cpu")


def test_worker_config_keeps_attention_backends_that_work():
    assert WorkerConfig(SIM_MODEL, attention_backend="torch").attention_backend == "torch"
    assert WorkerConfig(SIM_MODEL, attention_backend="cpu").attention_backend == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_worker_config_refuses_cuda_without_a_gpu():
    with pytest.raises(ConfigError, match="--device cuda: no CUDA device here"):
        WorkerConfig(SIM_MODEL, device="cuda")


def test_worker_config_refuses_max_model_len_beyond_the_model():
    with pytest.raises(
        ConfigError,
        match="--max-model-len=16384 exceeds the model's max_position_embeddings=8192",
    ):
        WorkerConfig(SIM_MODEL, device="sim", max_model_len=16384)
    assert WorkerConfig(SIM_MODEL, device="sim", max_model_len=8192).max_model_len == 8192
    assert WorkerConfig(SIM_MODEL, max_model_len=512).max_model_len == 512


def test_worker_config_max_model_len_needs_a_readable_model(tmp_path):
    with pytest.raises(ConfigError, match="config.json does not exist"):
        WorkerConfig(str(tmp_path), max_model_len=512)


def test_parse_layer_split_names_the_flag():
    assert parse_layer_split("15,15") == [15, 15]
    assert parse_layer_split(None) is None
    with pytest.raises(ConfigError, match="--layer-split='abc' is not a list of layer counts"):
        parse_layer_split("abc")


def test_worker_config_refuses_a_kv_budget_beyond_this_machine():
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with pytest.raises(ConfigError, match="--kv-cache-memory=.* is more than this machine's"):
        WorkerConfig(SIM_MODEL, kv_cache_memory=2 * memory)
    # the GPU profiles of a simulated device do not allocate it (docs/configuration.md)
    assert WorkerConfig(SIM_MODEL, device="sim", kv_cache_memory=2 * memory)


@pytest.mark.parametrize(
    "flag,overrides",
    [
        ("--sim-profile", {"sim_profile": "h100"}),
        ("--sim-link-bandwidth", {"sim_link_bandwidth": 100.0}),
        ("--sim-link-latency", {"sim_link_latency": 5.0}),
        ("--sim-tensor-parallel-size", {"sim_tensor_parallel_size": 2}),
    ],
)
def test_worker_config_refuses_sim_flags_on_a_real_device(flag, overrides):
    with pytest.raises(ConfigError, match=f"{flag} needs --device sim"):
        WorkerConfig(SIM_MODEL, **overrides)
    assert WorkerConfig(SIM_MODEL, device="sim", **overrides)


def write_config(directory, **extra) -> str:
    config = json.loads((MODELS_DIR / "smollm2-135m" / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **extra}))
    return str(directory)


def test_worker_config_refuses_quantization_ignore_without_quantization(tmp_path):
    model_dir = write_config(tmp_path)
    with pytest.raises(ConfigError, match="--quantization-ignore needs --quantization"):
        WorkerConfig(model_dir, quantization_ignore=("down_proj",))
    with pytest.raises(ConfigError, match="--quantization-ignore needs --quantization"):
        WorkerConfig(model_dir, quantization_ignore=())  # "none"
    config = WorkerConfig(model_dir, quantization="fp8", quantization_ignore=("down_proj",))
    assert config.quantization_ignore == ("down_proj",)


def test_worker_config_keeps_quantization_ignore_for_an_fp8_checkpoint(tmp_path):
    model_dir = write_config(tmp_path, quantization_config={"quant_method": "fp8"})
    config = WorkerConfig(model_dir, quantization_ignore=("down_proj",))
    assert config.quantization_ignore == ("down_proj",)


def run_worker(*flags: str) -> subprocess.CompletedProcess:
    port = free_port()
    argv = [sys.executable, "-m", "services.cli", "worker", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--dist-addr", f"127.0.0.1:{free_port()}", *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_worker_cli_refuses_a_bad_layer_split_in_one_line():
    done = run_worker(
        "--model", SIM_MODEL, "--device", "sim", "--stages", "2", "--layer-split", "abc"
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "conveyor worker: error: --layer-split='abc' is not a list of layer counts: use e.g. 15,15"
    ]


def test_worker_refused_while_loading_exits_2_without_shutdown_noise():
    done = run_worker(
        "--model", SIM_MODEL, "--device", "sim", "--stages", "2", "--layer-split", "10,10"
    )
    assert done.returncode == 2
    assert "layer_split=[10, 10] sums to 20 but the model has 30 layers" in done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
