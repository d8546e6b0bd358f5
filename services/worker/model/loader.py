"""Load one pipeline stage of a HF safetensors checkpoint, reading only that stage's tensors.

A model directory holds `config.json` and either `model.safetensors` or a sharded
`model.safetensors.index.json` (+ the shards it names). Tensors are opened lazily with
`safetensors.safe_open`, so a stage never reads (or maps into memory pages) the weights of
another stage's layers. Every failure raises `ModelLoadError` naming the file and problem.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.errors import ModelLoadError
from services.worker.model.config import ModelConfig
from services.worker.model.llama import StageModel
from services.worker.model.stages import StageSpec

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsReader:
    """Reads named tensors from a model directory; records every name it read."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.names_read: list[str] = []
        self._file_of = self._weight_map()
        self._handles: dict[Path, object] = {}

    def _weight_map(self) -> dict[str, Path]:
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
            return {name: self.model_dir / file for name, file in weight_map.items()}
        single = self.model_dir / SINGLE_FILE
        if not single.is_file():
            raise ModelLoadError(
                f"{self.model_dir} has no weights: expected {SINGLE_FILE} or {INDEX_FILE}"
            )
        with self._open(single) as handle:
            return {name: single for name in handle.keys()}  # noqa: SIM118

    def _open(self, path: Path):
        if not path.is_file():
            raise ModelLoadError(f"weights file {path} does not exist (named by {INDEX_FILE})")
        try:
            return safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors raises its own error types
            raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from exc

    def has(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Read `name`, check it has `shape`, convert to `dtype`."""
        path = self._file_of.get(name)
        if path is None:
            raise ModelLoadError(f"{self.model_dir}: tensor {name!r} is missing from the weights")
        if path not in self._handles:
            self._handles[path] = self._open(path).__enter__()
        tensor = self._handles[path].get_tensor(name)
        self.names_read.append(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ModelLoadError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, but config.json "
                f"implies {tuple(shape)}"
            )
        return tensor.to(dtype)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ModelLoadError(f"dtype={name!r} is not supported: choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_stage_model(
    model_dir: str | Path,
    stage: StageSpec,
    dtype: str = "float32",
    attention_backend: str = "torch",
    max_positions: int | None = None,
    reader: SafetensorsReader | None = None,
) -> StageModel:
    """Build the StageModel of `stage` and fill it from `model_dir` (only its tensors)."""
    config = ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype)
    reader = reader or SafetensorsReader(model_dir)
    with torch.device("meta"):
        model = StageModel(config, stage, attention_backend, max_positions)
    model.rotary = type(model.rotary)(config, max_positions or config.max_position_embeddings)
    try:
        _fill(model, reader, torch_dtype)
    finally:
        reader.close()
    logger.info(
        "loaded stage %d/%d (layers %d..%d, %d tensors) from %s",
        stage.stage_index,
        stage.num_stages,
        stage.layer_start,
        stage.layer_end - 1,
        len(reader.names_read),
        model_dir,
    )
    return model.eval()


def _fill(model: StageModel, reader: SafetensorsReader, dtype: torch.dtype) -> None:
    config, stage = model.config, model.stage
    vocab_hidden = (config.vocab_size, config.hidden_size)
    if stage.is_first:
        model.embed_tokens.weight = _param(
            reader.get("model.embed_tokens.weight", vocab_hidden, dtype)
        )
    for local, layer in enumerate(model.layers):
        _fill_layer(layer, f"model.layers.{stage.layer_start + local}.", config, reader, dtype)
    if stage.is_last:
        model.norm.weight = _param(reader.get("model.norm.weight", (config.hidden_size,), dtype))
        if config.tie_word_embeddings and stage.is_first:
            model.lm_head_weight = model.embed_tokens.weight
        elif config.tie_word_embeddings:
            model.lm_head_weight = reader.get("model.embed_tokens.weight", vocab_hidden, dtype)
        else:
            model.lm_head_weight = reader.get("lm_head.weight", vocab_hidden, dtype)


def _fill_layer(layer, prefix: str, config: ModelConfig, reader, dtype) -> None:
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    attn, mlp = layer.self_attn, layer.mlp

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return reader.get(prefix + name, shape, dtype)

    layer.input_layernorm.weight = _param(get("input_layernorm.weight", (hidden,)))
    layer.post_attention_layernorm.weight = _param(
        get("post_attention_layernorm.weight", (hidden,))
    )
    sizes = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
    attn.qkv_proj.weight = _param(
        torch.cat([get(f"self_attn.{n}.weight", (s, hidden)) for n, s in sizes.items()])
    )
    if config.qkv_bias:
        attn.qkv_proj.bias = _param(
            torch.cat([get(f"self_attn.{n}.bias", (s,)) for n, s in sizes.items()])
        )
    attn.o_proj.weight = _param(get("self_attn.o_proj.weight", (hidden, q_size)))
    if config.o_bias:
        attn.o_proj.bias = _param(get("self_attn.o_proj.bias", (hidden,)))
    gate_up = [get(f"mlp.{n}.weight", (inter, hidden)) for n in ("gate_proj", "up_proj")]
    mlp.gate_up_proj.weight = _param(torch.cat(gate_up))
    mlp.down_proj.weight = _param(get("mlp.down_proj.weight", (hidden, inter)))
    if config.mlp_bias:
        mlp.gate_up_proj.bias = _param(
            torch.cat([get(f"mlp.{n}.bias", (inter,)) for n in ("gate_proj", "up_proj")])
        )
        mlp.down_proj.bias = _param(get("mlp.down_proj.bias", (hidden,)))


def _param(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor.contiguous(), requires_grad=False)
