"""Layer splits across stages, and the KV cache sized from a memory budget."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import ConfigError
from services.common.units import parse_bytes
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KVCache, KVCacheSpec
from services.worker.model.stages import split_layers, stage_spec


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "expected"),
    [
        (30, 1, [30]),
        (30, 3, [10, 10, 10]),
        (30, 4, [7, 8, 8, 7]),
        (7, 3, [2, 3, 2]),
        (8, 8, [1] * 8),
    ],
)
def test_split_layers_even_with_remainder_before_last(num_layers, num_stages, expected):
    assert split_layers(num_layers, num_stages) == expected


def test_stage_spec_covers_every_layer_once():
    specs = [stage_spec(30, 4, i, [5, 10, 10, 5]) for i in range(4)]
    assert [list(s.layer_ids) for s in specs] == [
        list(range(0, 5)),
        list(range(5, 15)),
        list(range(15, 25)),
        list(range(25, 30)),
    ]
    assert specs[0].is_first and specs[-1].is_last and not specs[1].is_last


@pytest.mark.parametrize(
    ("split", "message"),
    [
        ([10, 10], "has 2 entries but num_stages=3"),
        ([10, 0, 20], "has an entry < 1"),
        ([10, 10, 11], "sums to 31 but the model has 30 layers"),
    ],
)
def test_split_layers_rejects_bad_explicit_split(split, message):
    with pytest.raises(ConfigError, match=message):
        split_layers(30, 3, split)


def test_split_layers_rejects_bad_stage_counts():
    with pytest.raises(ConfigError, match=r"num_stages=9 is out of range"):
        split_layers(30, 9)
    with pytest.raises(ConfigError, match="exceeds the model's 3 layers"):
        split_layers(3, 4)


def smollm_spec(block_size: int = 16, num_layers: int = 30) -> KVCacheSpec:
    return KVCacheSpec(num_layers, 3, 64, block_size, torch.float32)


def test_kv_cache_blocks_from_budget():
    spec = smollm_spec(num_layers=10)  # one stage of three of SmolLM2-135M
    assert spec.bytes_per_block == 2 * 10 * 16 * 3 * 64 * 4
    cache = KVCache.from_budget(spec, parse_bytes("8MiB"), max_model_len=512)
    assert cache.num_blocks == 8 * 2**20 // spec.bytes_per_block
    k, v = cache.layers[0]
    assert len(cache.layers) == 10 and k.shape == v.shape == (cache.num_blocks, 16, 3, 64)


def test_kv_cache_too_small_names_the_numbers():
    spec = smollm_spec()
    with pytest.raises(ConfigError) as info:
        KVCache.from_budget(spec, parse_bytes("1MiB"), max_model_len=2048)
    message = str(info.value)
    for number in ("1048576 bytes", "737280 bytes each", "needs 128 blocks", "max_model_len=2048"):
        assert number in message, message


def test_kv_cache_rejects_unsupported_block_size():
    with pytest.raises(ConfigError, match="block_size=12"):
        smollm_spec(block_size=12)


def test_worker_config_parses_memory_and_validates():
    config = WorkerConfig("/models/x", kv_cache_memory="2GiB", num_stages=3, stage_index=2)
    assert config.kv_cache_memory == 2 * 2**30
    with pytest.raises(ConfigError, match="stage_index=3"):
        WorkerConfig("/models/x", num_stages=3, stage_index=3)
    with pytest.raises(ConfigError, match="attention_backend='cuda'"):
        WorkerConfig("/models/x", attention_backend="cuda")


@pytest.mark.parametrize(
    "num_layers,num_stages,extra,expected",
    [
        (30, 2, 6.0, [18, 12]),  # SmolLM2-135M: the logits cost ~6 layers in decode
        (30, 3, 6.0, [12, 12, 6]),
        (30, 8, 6.0, [4, 4, 4, 4, 4, 5, 4, 1]),  # the last stage keeps at least one layer
        (3, 3, 6.0, [1, 1, 1]),
        (30, 1, 6.0, [30]),
        (30, 2, 0.0, [15, 15]),
    ],
)
def test_split_layers_balances_the_last_stages_logits_work(num_layers, num_stages, extra, expected):
    counts = split_layers(num_layers, num_stages, last_stage_extra=extra)
    assert counts == expected and sum(counts) == num_layers


def test_split_layers_explicit_split_wins_over_the_cost_estimate():
    assert split_layers(30, 2, [15, 15], last_stage_extra=6.0) == [15, 15]


def test_logits_layer_equivalents_of_smollm2_shape():
    from services.worker.model.stages import logits_layer_equivalents

    # vocab 49152 x hidden 576 against one layer's 3,538,944 weights, discounted by 0.75
    assert logits_layer_equivalents(49152, 576, 3_538_944) == pytest.approx(6.0)
