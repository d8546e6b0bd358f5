"""New weights for a live stage: stage them beside the live ones, then swap them in.

An update has two phases so that a pipeline changes weights on every stage or on none
(the scheduler drives them, services/scheduler/weights.py):

    stage    read (files) or receive (trainer) the stage's tensors into fresh modules: a
             decoder layer is rebuilt whole, exactly as the loader builds it (q/k/v and
             gate/up fused, oneDNN-packed when the live one is), so the live model is
             untouched and a bad tensor fails here
    commit   swap the fresh modules in, between two steps (the engine's runner lock)

The unit is a decoder layer (or the embedding, the final norm, lm_head): a packed weight
cannot be patched tensor by tensor, and a trainer changes whole layers anyway.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from services.common.errors import InvalidRequest, ModelLoadError
from services.worker.model.llama import DecoderLayer, StageModel, fuse_layer
from services.worker.model.loader import _fill_layer, _param
from services.worker.model.packed_linear import PackedLinear, pack_linears
from services.worker.model.quant import quantize_like

logger = logging.getLogger(__name__)

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(slots=True)
class WeightSelection:
    """Which of a stage's modules an update replaces."""

    layer_ids: list[int] = field(default_factory=list)
    """Global decoder layer indices, all owned by the stage."""
    embed: bool = False
    norm: bool = False
    lm_head: bool = False

    @property
    def is_empty(self) -> bool:
        return not (self.layer_ids or self.embed or self.norm or self.lm_head)


@dataclass(slots=True)
class StagedWeights:
    """Fresh modules waiting for `commit`, and the version they make."""

    version: int
    layers: dict[int, DecoderLayer] = field(default_factory=dict)
    """Local layer index -> the rebuilt layer."""
    embed: torch.Tensor | None = None
    norm: torch.Tensor | None = None
    lm_head: torch.Tensor | None = None
    lm_head_packed: PackedLinear | None = None
    """The logits matmul in oneDNN's layout, packed here rather than at commit (a 49k-row
    reorder takes a quarter of a second on the project's CPU)."""
    num_tensors: int = 0


class TensorReader:
    """Received tensors behind the loader's reader interface (`get`, `has`, `close`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._tensors = tensors
        self.names_read: list[str] = []

    def has(self, name: str) -> bool:
        return name in self._tensors

    def get(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """`name`, checked against its full `shape`; `rows` / `cols`: a tensor-parallel
        rank's [start, end) of the first / second dimension."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"the trainer sent part of a layer but not {name!r}")
        if tuple(tensor.shape) != tuple(shape):
            raise ModelLoadError(
                f"the trainer sent {name!r} with shape {tuple(tensor.shape)}; this model's "
                f"config implies {tuple(shape)}"
            )
        self.names_read.append(name)
        if rows is not None:
            tensor = tensor[rows[0] : rows[1]]
        if cols is not None:
            tensor = tensor[:, cols[0] : cols[1]]
        return tensor.to(dtype)

    def close(self) -> None:
        self._tensors = {}


def owns(model: StageModel, name: str) -> bool:
    """Whether tensor `name` (a HF checkpoint name) is one this stage serves."""
    stage, config = model.stage, model.config
    match = _LAYER_NAME.match(name)
    if match:
        return stage.layer_start <= int(match.group(1)) < stage.layer_end
    if name == EMBED:
        return stage.is_first or (stage.is_last and config.tie_word_embeddings)
    if name == NORM:
        return stage.is_last
    if name == LM_HEAD:
        return stage.is_last and not config.tie_word_embeddings
    return False


def select_layers(model: StageModel, layer_ids: list[int]) -> WeightSelection:
    """A file update: `layer_ids` (global; the ones this stage owns), or everything."""
    stage, num_layers = model.stage, model.config.num_hidden_layers
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise InvalidRequest(f"layers {bad} do not exist: the model has layers 0-{num_layers - 1}")
    if not layer_ids:
        return WeightSelection(
            list(range(stage.layer_start, stage.layer_end)),
            embed=stage.is_first,
            norm=stage.is_last,
            lm_head=stage.is_last,
        )
    owned = sorted({i for i in layer_ids if stage.layer_start <= i < stage.layer_end})
    return WeightSelection(owned)


def select_received(model: StageModel, names: set[str]) -> WeightSelection:
    """A trainer update: the modules of the tensors received (all of them owned)."""
    stage, config = model.stage, model.config
    layer_ids = sorted({int(m.group(1)) for n in names if (m := _LAYER_NAME.match(n))})
    head_name = EMBED if config.tie_word_embeddings else LM_HEAD
    return WeightSelection(
        layer_ids,
        embed=stage.is_first and EMBED in names,
        norm=stage.is_last and NORM in names,
        lm_head=stage.is_last and head_name in names,
    )


def stage_weights(model: StageModel, reader, selection: WeightSelection, version: int):
    """Builds the selected modules from `reader` (a `SafetensorsReader` or `TensorReader`);
    returns `StagedWeights`. Raises `ModelLoadError` for a missing or misshapen tensor."""
    config, stage, vocab_rows = model.config, model.stage, model.tp.shard.vocab
    dtype = _live_dtype(model)
    device = _live_device(model)
    staged = StagedWeights(version)
    vocab_hidden = (config.vocab_size, config.hidden_size)
    try:
        for layer_id in selection.layer_ids:
            local = layer_id - stage.layer_start
            live = model.layers[local]
            with torch.device("meta"):
                layer = DecoderLayer(config, live.self_attn.attention_fn, model.tp)
            _fill_layer(layer, f"model.layers.{layer_id}.", config, reader, dtype)
            quantize_like(model, layer, dtype)
            # Packed as the live layer is: all its linears, or those quantization kept.
            packed = next((m for m in live.modules() if isinstance(m, PackedLinear)), None)
            if packed is not None:
                pack_linears(layer, keep_plain=packed.weight is not None)
            if live.fused:
                fuse_layer(layer, live.self_attn.attend)
            staged.layers[local] = layer.to(device).eval()
        if selection.embed:
            staged.embed = reader.get(EMBED, vocab_hidden, dtype, rows=vocab_rows).to(device)
        if selection.norm:
            staged.norm = reader.get(NORM, (config.hidden_size,), dtype).to(device)
        if selection.lm_head and config.tie_word_embeddings and stage.is_first:
            staged.lm_head = staged.embed  # one tensor, as the loader ties it
        elif selection.lm_head:
            name = EMBED if config.tie_word_embeddings else LM_HEAD
            staged.lm_head = reader.get(name, vocab_hidden, dtype, rows=vocab_rows).to(device)
        if staged.lm_head is not None and model.lm_head is not None:
            keep_plain = model.lm_head.weight is not None
            staged.lm_head_packed = PackedLinear(staged.lm_head, keep_plain=keep_plain)
        staged.num_tensors = len(reader.names_read)
    finally:
        reader.close()
    return staged


def commit(model: StageModel, staged: StagedWeights) -> None:
    """Swaps the staged modules into `model` (call between steps)."""
    for local, layer in staged.layers.items():
        model.layers[local] = layer
    model.forget_decode_stack()  # it holds the old layers' weights
    if staged.embed is not None:
        model.embed_tokens.weight = _param(staged.embed)
    if staged.norm is not None:
        model.norm.weight = _param(staged.norm)
    if staged.lm_head is not None:
        head = staged.lm_head
        if model.config.tie_word_embeddings and model.stage.is_first:
            head = model.embed_tokens.weight  # the Parameter just swapped in
        if staged.lm_head_packed is not None:
            model.lm_head = staged.lm_head_packed
        else:
            model.lm_head_weight = head


def _live_dtype(model: StageModel) -> torch.dtype:
    return model.layers[0].input_layernorm.weight.dtype


def _live_device(model: StageModel) -> torch.device:
    return model.layers[0].input_layernorm.weight.device


def is_stage_model(model: nn.Module) -> bool:
    """False for a simulated stage (`--device sim`), which holds no weights to update."""
    return isinstance(model, StageModel)
