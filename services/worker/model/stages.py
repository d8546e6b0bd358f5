"""Which decoder layers each pipeline stage owns.

By default layers are split evenly; the remainder goes to the stages just before the last
one, like vLLM's `get_pp_indices` (the last stage also runs the final norm, lm_head and
the sampler, so it keeps the smaller share):

    30 layers, 4 stages -> [7, 8, 8, 7]        7 layers, 3 stages -> [2, 3, 2]
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


def split_layers(
    num_layers: int, num_stages: int, layer_split: list[int] | None = None
) -> list[int]:
    """Number of layers per stage; raises ConfigError naming the bad value."""
    if not 1 <= num_stages <= MAX_STAGES:
        raise ConfigError(f"num_stages={num_stages} is out of range: must be in [1, {MAX_STAGES}]")
    if layer_split is not None:
        return _check_split(num_layers, num_stages, list(layer_split))
    if num_stages > num_layers:
        raise ConfigError(
            f"num_stages={num_stages} exceeds the model's {num_layers} layers: "
            "each stage needs at least one layer"
        )
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
    num_layers: int, num_stages: int, stage_index: int, layer_split: list[int] | None = None
) -> StageSpec:
    """The StageSpec of stage `stage_index` in a pipeline of `num_stages`."""
    counts = split_layers(num_layers, num_stages, layer_split)
    if not 0 <= stage_index < num_stages:
        raise ConfigError(
            f"stage_index={stage_index} is out of range: must be in [0, {num_stages - 1}]"
        )
    start = sum(counts[:stage_index])
    return StageSpec(stage_index, num_stages, start, start + counts[stage_index])
