"""Tensor parallelism inside a stage: shard layouts, and a stage sharded over 2 gloo ranks
(spawned processes) decoding exactly like the unsharded stage, each rank reading only its
bytes of the checkpoint."""

from __future__ import annotations

import argparse

import pytest
import torch

from services.common.errors import ConfigError
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KVCache, KVCacheSpec
from services.worker.model.config import ModelConfig
from services.worker.model.loader import SafetensorsReader, load_stage_model
from services.worker.model.stages import stage_spec
from services.worker.model.tensor_parallel import check_tensor_parallel, tensor_shard
from services.worker.runner import StageRunner
from tests.worker.tp_utils import greedy, run_ranks
from tests.worker.utils import TinyPlanner, make_prompts, make_tiny_model, run_plans


def _config(heads: int, kv_heads: int, inter: int = 1536, vocab: int = 49152) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab,
        hidden_size=64 * heads,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
    )


def test_tensor_shard_deals_whole_gqa_groups_unevenly_when_needed():
    config = _config(9, 3)  # SmolLM2-135M's heads
    shards = [tensor_shard(config, r, 2) for r in range(2)]
    assert [s.kv_heads for s in shards] == [(0, 2), (2, 3)]
    assert [s.q_heads for s in shards] == [(0, 6), (6, 9)]
    assert [s.vocab for s in shards] == [(0, 24576), (24576, 49152)]
    assert [s.intermediate for s in shards] == [(0, 768), (768, 1536)]


def test_tensor_shard_replicates_kv_heads_over_more_ranks():
    config = _config(8, 2)
    shards = [tensor_shard(config, r, 4) for r in range(4)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.q_heads for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize(
    ("config", "size", "numbers"),
    [
        (_config(9, 3), 4, "num_key_value_heads=3"),
        (_config(4, 2), 8, "2 query heads per KV head"),
        (_config(4, 4, inter=1000), 3, "intermediate_size=1000"),
        (_config(4, 4, vocab=49153), 2, "vocab_size=49153"),
        (_config(4, 4), 65, "tensor_parallel_size=65"),
    ],
)
def test_check_tensor_parallel_names_the_numbers(config, size, numbers):
    with pytest.raises(ConfigError, match=numbers):
        check_tensor_parallel(config, size)


@pytest.mark.parametrize(("arch", "kv_heads", "tied"), [("llama", 1, True), ("qwen2", 2, False)])
def test_sharded_stage_decodes_like_the_unsharded_one(tmp_path, arch, kv_heads, tied):
    """2 ranks (KV heads replicated for llama, split for qwen2 with q/k/v biases): rank 0's
    logits equal the unsharded stage's to float32 summation order, tokens exactly."""
    model_dir = make_tiny_model(tmp_path / "model", arch, num_kv_heads=kv_heads, tied=tied)
    reader = SafetensorsReader(model_dir)
    model = load_stage_model(model_dir, stage_spec(3, 1, 0), reader=reader)
    spec = KVCacheSpec(3, kv_heads, model.config.head_dim, 8, torch.float32)
    outputs, logits = greedy(
        StageRunner(model, KVCache(spec, 64)), TinyPlanner, make_prompts, run_plans
    )
    ranks = run_ranks(model_dir, 2, tmp_path)
    for rank in ranks:
        assert rank["outputs"] == outputs  # every rank holds the sampled tokens
    for request_id, steps in logits.items():
        torch.testing.assert_close(
            torch.stack(ranks[0]["logits"][request_id]), torch.stack(steps), atol=1e-4, rtol=0
        )
    # Each rank read its own bytes: together, the whole stage once, plus what is replicated
    # (the norms, and with one KV head the k/v projections).
    config = model.config
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size * 4
    kv_proj = 2 * config.num_hidden_layers * config.head_dim * config.hidden_size * 4
    replicated = norms + (kv_proj if kv_heads == 1 else 0)
    assert all(r["bytes_read"] < reader.bytes_read for r in ranks)
    assert sum(r["bytes_read"] for r in ranks) == reader.bytes_read + replicated


def test_worker_config_refuses_a_model_that_does_not_shard(smollm2_dir):
    with pytest.raises(ConfigError, match="num_key_value_heads=3"):
        WorkerConfig(model_dir=str(smollm2_dir), tensor_parallel_size=4, tp_rank=0)
    with pytest.raises(ConfigError, match=r"tp_rank=2 is out of range: must be in \[0, 1\]"):
        WorkerConfig(model_dir=str(smollm2_dir), tensor_parallel_size=2, tp_rank=2)
    assert WorkerConfig(model_dir=str(smollm2_dir), tensor_parallel_size=2, tp_rank=1).threads


def test_conveyor_up_refuses_more_ranks_than_cores_unless_oversubscribed(smollm2_dir):
    from services.common.affinity import available_cpus
    from services.launcher import check_parallel

    cores = len(available_cpus())
    args = argparse.Namespace(
        model=str(smollm2_dir), stages=cores, tensor_parallel_size=2, device="cpu"
    )
    with pytest.raises(ConfigError, match=f"= {2 * cores} worker processes, but this machine"):
        check_parallel(argparse.Namespace(**vars(args), oversubscribe=False))
    assert check_parallel(argparse.Namespace(**vars(args), oversubscribe=True)) == 2
