"""Load one pipeline stage of a HF safetensors checkpoint, reading only that stage's tensors.

A model directory holds `config.json` and either `model.safetensors` or a sharded
`model.safetensors.index.json` (+ the shards it names). Tensors are opened lazily with
`safetensors.safe_open`, so a stage never reads (or maps into memory pages) the weights of
another stage's layers. A tensor-parallel rank reads only its slices (`get_slice`), never
a whole sharded tensor. Every failure raises `ModelLoadError` naming the file and problem.
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
from services.worker.model.tensor_parallel import TensorParallel, tensor_shard

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsReader:
    """Reads named tensors from a model directory; records every name it read."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.names_read: list[str] = []
        self.bytes_read = 0
        """Bytes of tensor data read (slices count their own bytes only)."""
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

    def get(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Read `name`, check it has `shape`, convert to `dtype`.

        `rows` / `cols`: read only [start, end) of the first / second dimension (a
        tensor-parallel shard); the bytes outside are never read."""
        path = self._file_of.get(name)
        if path is None:
            raise ModelLoadError(f"{self.model_dir}: tensor {name!r} is missing from the weights")
        if path not in self._handles:
            self._handles[path] = self._open(path).__enter__()
        view = self._handles[path].get_slice(name)
        if tuple(view.get_shape()) != tuple(shape):
            raise ModelLoadError(
                f"{path}: tensor {name!r} has shape {tuple(view.get_shape())}, but config.json "
                f"implies {tuple(shape)}"
            )
        if rows is None and cols is None:
            tensor = view[:]
        elif cols is None:
            tensor = view[rows[0] : rows[1]]
        else:
            row_range = slice(*rows) if rows is not None else slice(None)
            tensor = view[row_range, cols[0] : cols[1]]
        self.names_read.append(name)
        self.bytes_read += tensor.numel() * tensor.element_size()
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
    tp_rank: int = 0,
    tensor_parallel_size: int = 1,
) -> StageModel:
    """Build the StageModel of `stage` and fill it from `model_dir` (only its tensors; on
    a tensor-parallel rank only its shard of them, model/tensor_parallel.py)."""
    config = ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype)
    tp = TensorParallel(tensor_shard(config, tp_rank, tensor_parallel_size))
    reader = reader or SafetensorsReader(model_dir)
    with torch.device("meta"):
        model = StageModel(config, stage, attention_backend, max_positions, tp)
    model.rotary = type(model.rotary)(config, max_positions or config.max_position_embeddings)
    try:
        _fill(model, reader, torch_dtype)
    finally:
        reader.close()
    logger.info(
        "loaded stage %d/%d tp rank %d/%d (layers %d..%d, %d tensors, %d MiB) from %s",
        stage.stage_index,
        stage.num_stages,
        tp_rank,
        tensor_parallel_size,
        stage.layer_start,
        stage.layer_end - 1,
        len(reader.names_read),
        reader.bytes_read >> 20,
        model_dir,
    )
    return model.eval()


def _fill(model: StageModel, reader: SafetensorsReader, dtype: torch.dtype) -> None:
    config, stage, shard = model.config, model.stage, model.tp.shard
    vocab_hidden = (config.vocab_size, config.hidden_size)
    if stage.is_first:
        model.embed_tokens.weight = _param(
            reader.get("model.embed_tokens.weight", vocab_hidden, dtype, rows=shard.vocab)
        )
    for local, layer in enumerate(model.layers):
        _fill_layer(layer, f"model.layers.{stage.layer_start + local}.", config, reader, dtype)
    if stage.is_last:
        model.norm.weight = _param(reader.get("model.norm.weight", (config.hidden_size,), dtype))
        if config.tie_word_embeddings and stage.is_first:
            model.lm_head_weight = model.embed_tokens.weight
        else:
            name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
            model.lm_head_weight = reader.get(name, vocab_hidden, dtype, rows=shard.vocab)


def _fill_layer(layer, prefix: str, config: ModelConfig, reader, dtype) -> None:
    """One decoder layer; q/k/v and gate/up by rows (output columns of the projection),
    o_proj and down by input columns: this rank's shard only (`layer`'s TensorParallel)."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_size = config.num_attention_heads * head_dim
    kv_size = config.num_key_value_heads * head_dim
    attn, mlp, shard = layer.self_attn, layer.mlp, layer.self_attn.tp.shard
    q_rows = (shard.q_heads[0] * head_dim, shard.q_heads[1] * head_dim)
    kv_rows = (shard.kv_heads[0] * head_dim, shard.kv_heads[1] * head_dim)
    is_rank0 = shard.rank == 0

    def get(name: str, shape: tuple[int, ...], **part) -> torch.Tensor:
        return reader.get(prefix + name, shape, dtype, **part)

    layer.input_layernorm.weight = _param(get("input_layernorm.weight", (hidden,)))
    layer.post_attention_layernorm.weight = _param(
        get("post_attention_layernorm.weight", (hidden,))
    )
    sizes = {"q_proj": (q_size, q_rows), "k_proj": (kv_size, kv_rows), "v_proj": (kv_size, kv_rows)}
    attn.qkv_proj.weight = _param(
        torch.cat(
            [get(f"self_attn.{n}.weight", (s, hidden), rows=r) for n, (s, r) in sizes.items()]
        )
    )
    if config.qkv_bias:
        attn.qkv_proj.bias = _param(
            torch.cat([get(f"self_attn.{n}.bias", (s,), rows=r) for n, (s, r) in sizes.items()])
        )
    attn.o_proj.weight = _param(get("self_attn.o_proj.weight", (hidden, q_size), cols=q_rows))
    if config.o_bias and is_rank0:  # added once: the all-reduce sums every rank's output
        attn.o_proj.bias = _param(get("self_attn.o_proj.bias", (hidden,)))
    gate_up = [
        get(f"mlp.{n}.weight", (inter, hidden), rows=shard.intermediate)
        for n in ("gate_proj", "up_proj")
    ]
    mlp.gate_up_proj.weight = _param(torch.cat(gate_up))
    mlp.down_proj.weight = _param(
        get("mlp.down_proj.weight", (hidden, inter), cols=shard.intermediate)
    )
    if config.mlp_bias:
        mlp.gate_up_proj.bias = _param(
            torch.cat(
                [
                    get(f"mlp.{n}.bias", (inter,), rows=shard.intermediate)
                    for n in ("gate_proj", "up_proj")
                ]
            )
        )
        if is_rank0:
            mlp.down_proj.bias = _param(get("mlp.down_proj.bias", (hidden,)))


def _param(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor.contiguous(), requires_grad=False)
