"""Loading one stage: only its tensors are read; malformed directories fail clearly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.errors import ModelLoadError
from services.worker.model import loader
from services.worker.model.config import ModelConfig
from services.worker.model.loader import load_stage_model
from services.worker.model.stages import stage_spec
from tests.worker.utils import LLAMA3_ROPE, make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), num_kv_heads=2, tied=True)


@pytest.fixture
def spy_reads(monkeypatch):
    """Records every tensor name fetched through safetensors, below our own bookkeeping."""
    names: list[str] = []
    real_open = loader.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.handle = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            names.append(name)
            return self.inner.get_tensor(name)

        def get_slice(self, name):
            names.append(name)
            return self.inner.get_slice(name)

    monkeypatch.setattr(loader, "safe_open", Spy)
    return names


def test_loader_stage_reads_only_its_own_tensors(model_dir, spy_reads):
    stage = stage_spec(3, 3, 1)  # the middle layer of three
    model = load_stage_model(model_dir, stage)
    assert spy_reads, "no tensor was read"
    assert all(name.startswith("model.layers.1.") for name in spy_reads), spy_reads
    assert len(spy_reads) == 9  # 2 norms, q/k/v/o, gate/up/down
    assert model.embed_tokens is None and model.norm is None


def test_loader_last_stage_of_tied_model_reads_embedding_for_lm_head(model_dir, spy_reads):
    model = load_stage_model(model_dir, stage_spec(3, 2, 1))
    assert "model.embed_tokens.weight" in spy_reads
    assert not any(name.startswith("model.layers.0.") for name in spy_reads)
    hf = load_file(model_dir / "model.safetensors")
    torch.testing.assert_close(model.lm_head_weight, hf["model.embed_tokens.weight"])


def test_loader_reads_sharded_checkpoint(model_dir, tmp_path):
    tensors = load_file(model_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, tmp_path / file)
        weight_map.update(dict.fromkeys(shard_names, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")
    model = load_stage_model(tmp_path, stage_spec(3, 1, 0), dtype="bfloat16")
    assert model.layers[2].mlp.down_proj.weight.dtype == torch.bfloat16


def copy_dir(model_dir, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    return target


def test_loader_missing_config_names_the_file(model_dir, tmp_path):
    target = copy_dir(model_dir, tmp_path)
    (target / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json does not exist"):
        load_stage_model(target, stage_spec(3, 1, 0))


def test_loader_missing_weights_names_the_expected_files(model_dir, tmp_path):
    target = copy_dir(model_dir, tmp_path)
    (target / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no weights: expected model\.safetensors"):
        load_stage_model(target, stage_spec(3, 1, 0))


def test_loader_missing_shard_names_the_shard(model_dir, tmp_path):
    target = copy_dir(model_dir, tmp_path)
    names = load_file(target / "model.safetensors").keys()
    (target / "model.safetensors").unlink()
    index = {"weight_map": dict.fromkeys(names, "model-00001-of-00002.safetensors")}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"model-00001-of-00002\.safetensors does not exist"):
        load_stage_model(target, stage_spec(3, 3, 2))


def test_loader_wrong_shape_names_tensor_and_shapes(model_dir, tmp_path):
    target = copy_dir(model_dir, tmp_path)
    tensors = load_file(target / "model.safetensors")
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"model\.layers\.2\.mlp\.up_proj\.weight.*\(100, 64\).*\(128, 64\)"
    ):
        load_stage_model(target, stage_spec(3, 1, 0))


def test_loader_missing_tensor_names_it(model_dir, tmp_path):
    target = copy_dir(model_dir, tmp_path)
    tensors = load_file(target / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*missing"
    ):
        load_stage_model(target, stage_spec(3, 1, 0))


def test_config_unsupported_architecture_is_named(model_dir, tmp_path):
    target = copy_dir(model_dir, tmp_path)
    raw = json.loads((target / "config.json").read_text())
    raw.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (target / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"config\.json.*GPT2LMHeadModel.*not supported"):
        ModelConfig.from_dir(target)


def test_config_reads_rope_from_either_transformers_layout():
    base = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=10,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    v5 = ModelConfig.from_dict({**base, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5e5}})
    v4 = ModelConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": LLAMA3_ROPE})
    legacy = ModelConfig.from_dict({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert v5.rope_theta == v4.rope_theta == 5e5
    assert v5.rope_scaling == v4.rope_scaling and v5.rope_scaling.factor == 8.0
    assert legacy.rope_scaling.rope_type == "linear" and legacy.rope_theta == 10000.0
    assert v5.head_dim == 16 and v5.num_key_value_heads == 4


def test_config_missing_field_is_named():
    with pytest.raises(ModelLoadError, match="'hidden_size'"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 10})


def test_config_eos_ids_add_generation_configs(model_dir, tmp_path):
    # Llama 3 Instruct: config.json names <|end_of_text|>, generation_config.json adds
    # <|eot_id|>; a chat turn ends on either (the router reads the same list).
    target = copy_dir(model_dir, tmp_path)
    assert ModelConfig.from_dir(target).eos_token_ids == (2,)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelConfig.from_dir(target).eos_token_ids == (2, 7)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ModelLoadError, match=r"generation_config\.json.*eos_token_id"):
        ModelConfig.from_dir(target)
