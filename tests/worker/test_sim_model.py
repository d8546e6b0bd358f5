"""The simulated device's pure parts: the timing model's numbers for known cases, the
hardware profiles, the shipped model configs, KV capacity, the deterministic tokens."""

from __future__ import annotations

import json

import pytest

from services.common.errors import ConfigError
from services.common.sampling import SamplingParams
from services.router.tokenizer import Tokenizer
from services.worker.config import WorkerConfig
from services.worker.model.config import ModelConfig
from services.worker.sim import MODELS_DIR
from services.worker.sim.fit import nelder_mead
from services.worker.sim.profiles import GPU_PROFILES, load_profile, profile_names
from services.worker.sim.timing import StageTimingModel
from services.worker.sim.tokens import TokenSource, request_key

MODELS = {  # published parameter counts, in billions
    "llama-2-70b": 68.98,
    "llama-3-8b": 8.03,
    "llama-3-70b": 70.55,
    "smollm2-135m": 0.1345,
}


def model(name: str) -> ModelConfig:
    return ModelConfig.from_dir(MODELS_DIR / name)


def whole(name: str, profile: str = "h100", **kwargs) -> StageTimingModel:
    config = model(name)
    return StageTimingModel(config, load_profile(profile), config.num_hidden_layers, **kwargs)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sim_model_configs_load_with_their_published_size(name):
    config = model(name)
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    params = config.num_hidden_layers * config.num_layer_params + embeddings
    assert params / 1e9 == pytest.approx(MODELS[name], rel=0.002)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sim_model_dirs_ship_a_tokenizer_the_router_loads(name):
    tokenizer = Tokenizer.from_dir(MODELS_DIR / name)
    assert tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"
    assert model(name).eos_token_ids == tuple(tokenizer.eos_token_ids)


def test_sim_profiles_load():
    assert {"h100", "h200", "a100", "cpu"} <= set(profile_names())
    h200 = load_profile("h200")
    assert (h200.peak_flops, h200.memory_bandwidth, h200.memory_bytes) == (989e12, 4.8e12, 141e9)
    assert load_profile("a100").peak_flops == 312e12
    for threads in (1, 2, 16):
        cpu = load_profile("cpu", threads=threads)
        assert cpu.device_kind == "cpu" and cpu.memory_bytes is None
        assert cpu.threads == min(threads, 2)


def test_sim_profile_file_and_errors(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**GPU_PROFILES["h100"].to_dict(), "name": "mine"}))
    assert load_profile(str(path)).name == "mine"
    with pytest.raises(ConfigError, match="unknown"):
        load_profile("h900")
    path.write_text(json.dumps({**GPU_PROFILES["h100"].to_dict(), "compute_efficiency": 3.0}))
    with pytest.raises(ConfigError, match="compute_efficiency"):
        load_profile(str(path))


def test_timing_decode_of_llama3_8b_on_h100_is_memory_bound():
    """Batch 32 at context 512: the weights are read once for the whole batch."""
    timing = whole("llama-3-8b")
    cost = timing.step([1] * 32, [512] * 32, num_sampled=32)
    h100 = GPU_PROFILES["h100"]
    weights_s = timing.weight_bytes / (h100.memory_bandwidth * h100.memory_efficiency)
    assert not cost.is_linear_compute_bound
    assert weights_s == pytest.approx(16.06e9 / (3.35e12 * 0.8), rel=0.001)  # ~6.0 ms
    assert cost.total_s == pytest.approx(weights_s, rel=0.2)
    assert cost.total_s > weights_s
    # a bigger batch costs little more: the weights dominate
    assert timing.step([1] * 64, [512] * 64, 64).total_s < 1.2 * cost.total_s


def test_timing_prefill_of_llama3_8b_on_h100_is_compute_bound():
    """A 2,048-token prefill: 2 FLOPs per weight per token, at the compute efficiency."""
    timing = whole("llama-3-8b")
    cost = timing.step([2048], [2048], num_sampled=1)
    config, h100 = model("llama-3-8b"), GPU_PROFILES["h100"]
    linear_s = 2 * 2048 * config.num_layer_params * 32 / (989e12 * h100.compute_efficiency)
    assert cost.is_linear_compute_bound
    assert cost.linear_s == pytest.approx(linear_s, rel=1e-9)
    assert cost.total_s == pytest.approx(linear_s, rel=0.15)
    # twice the tokens, about twice the time; attention grows faster
    longer = timing.step([4096], [4096], 1)
    assert longer.linear_s == pytest.approx(2 * cost.linear_s, rel=1e-9)
    assert longer.attention_s > 3 * cost.attention_s


def test_timing_attention_reads_each_sequences_context():
    """Decode attention is memory-bound: its time follows the KV bytes of the contexts."""
    timing = whole("llama-3-8b")
    short, long = timing.step([1] * 8, [1024] * 8, 8), timing.step([1] * 8, [4096] * 8, 8)
    assert long.attention_s == pytest.approx(4 * short.attention_s, rel=0.01)
    assert long.linear_s == short.linear_s


def test_timing_stages_and_tensor_parallel_divide_the_work():
    config = model("llama-3-70b")
    h200 = load_profile("h200")
    full = StageTimingModel(config, h200, 80).step([1] * 64, [256] * 64, 64)
    eighth = StageTimingModel(config, h200, 10, is_first=False, is_last=False)
    step = eighth.step([1] * 64, [256] * 64, 0)
    assert step.linear_s == pytest.approx(full.linear_s / 8, rel=1e-9)
    assert step.logits_s == 0 < full.logits_s
    tp2 = StageTimingModel(config, h200, 10, False, False, tensor_parallel_size=2)
    tp_step = tp2.step([1] * 64, [256] * 64, 0)
    assert tp_step.linear_s == pytest.approx(step.linear_s / 2, rel=0.01)
    assert tp_step.allreduce_s > 0 == step.allreduce_s
    assert tp2.weight_bytes == pytest.approx(eighth.weight_bytes / 2)


def test_timing_transfer_is_bytes_over_the_link():
    timing = whole("llama-3-70b", profile="h200")
    h200 = GPU_PROFILES["h200"]
    assert timing.transfer_s(256) == pytest.approx(
        h200.link_latency_s + 256 * 8192 * 2 / h200.link_bandwidth
    )


def test_kv_capacity_is_memory_minus_weights_over_block_bytes():
    config = model("llama-3-70b")
    h200 = GPU_PROFILES["h200"]
    timing = StageTimingModel(config, h200, 10, is_first=False, is_last=False)
    block_bytes = 16 * 10 * 2 * 8 * 128 * 2
    expected = int((141e9 * 0.9 - timing.weight_bytes) // block_bytes)
    assert timing.num_kv_blocks(16, None, 8192) == expected
    with pytest.raises(ConfigError, match="more stages"):  # 141 GB of weights on one H100
        whole("llama-3-70b").num_kv_blocks(16, None, 8192)
    cpu = StageTimingModel(config, load_profile("cpu"), 10, False, False)
    assert cpu.num_kv_blocks(16, 1 << 30, 4096) == (1 << 30) // (16 * 10 * 2 * 8 * 128 * 4)


def test_sim_worker_config_validates_its_flags():
    config = WorkerConfig(model_dir="m", device="sim", sim_profile="a100")
    assert config.sim_tensor_parallel_size == 1
    with pytest.raises(ConfigError, match="h900"):
        WorkerConfig(model_dir="m", device="sim", sim_profile="h900")
    with pytest.raises(ConfigError, match="sim_link_bandwidth"):
        WorkerConfig(model_dir="m", device="sim", sim_link_bandwidth=0)
    with pytest.raises(ConfigError, match="sim_tensor_parallel_size"):
        WorkerConfig(model_dir="m", device="sim", sim_tensor_parallel_size=0)


def test_sim_tokens_are_deterministic_regular_ids():
    source = TokenSource.from_model_dir(MODELS_DIR / "llama-3-70b", 128256, [2])
    assert 0 not in source.vocab_ids and 2 not in source.vocab_ids
    assert max(source.vocab_ids) < 400
    prompt = [5, 6, 7]
    greedy = SamplingParams(max_tokens=4096, ignore_eos=True)
    tokens = source.expected_tokens(prompt, greedy, 4096)
    assert tokens == source.expected_tokens(prompt, greedy, 4096)
    assert len(set(tokens)) > 300  # spread over the vocabulary
    assert all(t in source.vocab_ids for t in tokens)
    assert source.expected_tokens([5, 6, 8], greedy, 16) != tokens[:16]
    seeded = SamplingParams(seed=7, ignore_eos=True)
    assert source.expected_tokens([1, 2], seeded, 16) == source.expected_tokens([3], seeded, 17)[1:]
    assert request_key(seeded, [1]) == request_key(seeded, [2])


def test_sim_tokens_emit_eos_rarely_and_only_when_not_ignored():
    source = TokenSource(list(range(3, 400)), [2])
    sampling = SamplingParams(max_tokens=20000)
    tokens = source.expected_tokens([9], sampling, 20000)
    assert 0 < tokens.count(2) < 60  # about 1 in 1024
    ignoring = SamplingParams(max_tokens=20000, ignore_eos=True)
    assert 2 not in source.expected_tokens([9], ignoring, 20000)
    # min_tokens holds EOS off until then, as the real sampler's mask does
    first_eos = tokens.index(2)
    held = SamplingParams(max_tokens=20000, min_tokens=first_eos + 1)
    held_tokens = source.expected_tokens([9], held, 20000)
    assert 2 not in held_tokens[: first_eos + 1]
    assert held_tokens[first_eos + 1 :] == tokens[first_eos + 1 :]


def test_nelder_mead_finds_a_quadratic_minimum():
    import numpy as np

    best = nelder_mead(lambda x: float(np.sum((x - [1.0, -2.0, 0.5]) ** 2)), np.zeros(3))
    assert best == pytest.approx([1.0, -2.0, 0.5], abs=1e-3)
