"""Which decoder layers each pipeline stage owns.

Without a cost estimate layers are split evenly; the remainder goes to the stages just
before the last one, like vLLM's `get_pp_indices`:

    30 layers, 4 stages -> [7, 8, 8, 7]        7 layers, 3 stages -> [2, 3, 2]

The last stage also computes the logits of every sampled row (lm_head: vocab x hidden) and
samples, which in decode costs as much as several layers. Given that cost in layer
equivalents (`last_stage_extra`, see `logits_layer_equivalents`), the split balances work
instead of layers; SmolLM2-135M (extra ~6):

    30 layers, 2 stages -> [18, 12]           30 layers, 3 stages -> [12, 12, 6]
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import ConfigError

MAX_STAGES = 8


@dataclass(slots=True, frozen=True)
class StageSpec:
    """One stage of a pipeline: its index and the global layer ids [layer_start, layer_end)."""

    stage_index: int
    num_stages: int
    layer_start: int
    layer_end: int

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def layer_ids(self) -> range:
        return range(self.layer_start, self.layer_end)


def logits_layer_equivalents(
    vocab_size: int, hidden_size: int, layer_params: int, weight: float = 0.75
) -> float:
    """The last stage's logits work in decode, in decoder layers: lm_head weights over one
    layer's weights, discounted (a large GEMM runs faster than a layer's small ones;
    measured on SmolLM2: [18, 12] balanced its two stages, bubble 21% -> 5%)."""
    return weight * vocab_size * hidden_size / max(layer_params, 1)


def split_layers(
    num_layers: int,
    num_stages: int,
    layer_split: list[int] | None = None,
    last_stage_extra: float = 0.0,
) -> list[int]:
    """Number of layers per stage; raises ConfigError naming the bad value.

    `last_stage_extra`: the last stage's additional work in layer equivalents (0 splits
    layers evenly); every stage keeps at least one layer.
    """
    if not 1 <= num_stages <= MAX_STAGES:
        raise ConfigError(f"num_stages={num_stages} is out of range: must be in [1, {MAX_STAGES}]")
    if layer_split is not None:
        return _check_split(num_layers, num_stages, list(layer_split))
    if num_stages > num_layers:
        raise ConfigError(
            f"num_stages={num_stages} exceeds the model's {num_layers} layers: "
            "each stage needs at least one layer"
        )
    if last_stage_extra <= 0 or num_stages == 1:
        return _even(num_layers, num_stages)
    share = (num_layers + last_stage_extra) / num_stages
    num_last = min(max(1, round(share - last_stage_extra)), num_layers - (num_stages - 1))
    return [*_even(num_layers - num_last, num_stages - 1), num_last]


def _even(num_layers: int, num_stages: int) -> list[int]:
    counts = [num_layers // num_stages] * num_stages
    for i in range(2, num_layers % num_stages + 2):
        counts[-i] += 1
    return counts


def _check_split(num_layers: int, num_stages: int, split: list[int]) -> list[int]:
    if len(split) != num_stages:
        raise ConfigError(
            f"layer_split={split} has {len(split)} entries but num_stages={num_stages}: "
            "give one layer count per stage"
        )
    if any(n < 1 for n in split):
        raise ConfigError(f"layer_split={split} has an entry < 1: every stage needs a layer")
    if sum(split) != num_layers:
        raise ConfigError(
            f"layer_split={split} sums to {sum(split)} but the model has {num_layers} layers"
        )
    return split


def stage_spec(
    num_layers: int,
    num_stages: int,
    stage_index: int,
    layer_split: list[int] | None = None,
    last_stage_extra: float = 0.0,
) -> StageSpec:
    """The StageSpec of stage `stage_index` in a pipeline of `num_stages`."""
    counts = split_layers(num_layers, num_stages, layer_split, last_stage_extra)
    if not 0 <= stage_index < num_stages:
        raise ConfigError(
            f"stage_index={stage_index} is out of range: must be in [0, {num_stages - 1}]"
        )
    start = sum(counts[:stage_index])
    return StageSpec(stage_index, num_stages, start, start + counts[stage_index])
