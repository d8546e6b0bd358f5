"""Hardware profiles of the simulated device: peaks, efficiencies and overheads, as data.

A profile describes ONE device (one tensor-parallel rank of a stage). The timing model
(timing.py) divides each operator's FLOPs by `peak_flops x compute_efficiency` and its
bytes by `memory_bandwidth x memory_efficiency`.

The GPU profiles take their peaks from NVIDIA's datasheets (dense BF16 Tensor Core FLOP/s,
i.e. half the "with sparsity" figure; HBM bandwidth; memory size; NVLink):

    A100 80GB SXM   312 TFLOP/s (624 sparse)    2,039 GB/s   80 GB   NVLink 600 GB/s
    H100 SXM5       989 TFLOP/s (1,979 sparse)  3.35 TB/s    80 GB   NVLink 900 GB/s
    H200 SXM        989 TFLOP/s (1,979 sparse)  4.8 TB/s    141 GB   NVLink 900 GB/s

    (NVIDIA A100 Tensor Core GPU datasheet; H100 Tensor Core GPU datasheet; H200 Tensor
    Core GPU datasheet / product page. NVLink figures are total bidirectional bandwidth:
    half of it per direction.)

Their efficiencies and overheads are assumptions, not measurements (no GPU here), chosen
from what is commonly reported and stated once, for all three:

* compute 0.70: large BF16 GEMMs in cuBLAS reach 70-80 % of the dense peak;
* memory 0.80: weight streaming at small batch (GEMV-like) reaches ~80 % of HBM peak;
* attention compute 0.50 (FlashAttention-2 prefill: 50-70 % of peak), attention memory
  0.70 (paged decode kernels);
* 50 us per step + 5 us per layer launch overhead (CUDA graphs amortise the launches);
  0.5 us per sequence per step (inputs, sampling);
* 90 % of the memory for weights + KV cache (vLLM's default gpu_memory_utilization);
* stage-to-stage link: NVLink per direction x 0.8, 10 us latency (an 8-GPU HGX node holds
  the 8 stages); TP all-reduce: 0.8 x NVLink per direction as bus bandwidth, 20 us latency.

The "cpu" profile is this machine, measured and fitted: `python -m
services.worker.sim.measure` measures matmul GF/s and memory read GB/s, and `python -m
services.worker.sim.calibrate --write` fits the efficiencies and overheads to real SmolLM2
steps and writes cpu.json beside this file (see docs/simulation.md for the residuals). A
CPU profile has one variant per thread count; a worker takes the variant of its --threads.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import ConfigError

CPU_PROFILE_PATH = Path(__file__).with_name("cpu.json")
DEVICE_KINDS = ("cuda", "cpu")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(slots=True, frozen=True)
class HardwareProfile:
    """One device (one TP rank) as the timing model sees it. Units: FLOP/s, bytes/s, s."""

    name: str
    description: str
    device_kind: str
    """What the stage reports as its device in Describe ("cuda" or "cpu"): the scheduler
    sizes its default step token budget by it."""
    dtype: str
    """The modeled dtype of weights, KV cache and activations ("bfloat16", "float32")."""
    peak_flops: float
    """Dense matmul peak in `dtype`, FLOP/s."""
    memory_bandwidth: float
    """Peak memory read bandwidth, bytes/s."""
    memory_bytes: int | None
    """Memory of one device; None: the KV budget is the worker's --kv-cache-memory (CPU)."""
    compute_efficiency: float = 0.7
    """Achieved / peak FLOP/s of the matmuls (linear layers, logits)."""
    memory_efficiency: float = 0.8
    """Achieved / peak bandwidth streaming weights and activations."""
    attention_compute_efficiency: float = 0.5
    attention_memory_efficiency: float = 0.7
    step_overhead_s: float = 50e-6
    """Per step: launches, synchronisation."""
    layer_overhead_s: float = 5e-6
    """Per decoder layer per step."""
    seq_overhead_s: float = 0.5e-6
    """Per sequence per step (input building, sampling)."""
    memory_utilization: float = 0.9
    """Share of `memory_bytes` for weights + KV cache."""
    link_bandwidth: float = 360e9
    """Stage-to-stage activations, bytes/s (effective)."""
    link_latency_s: float = 10e-6
    tp_bandwidth: float = 360e9
    """All-reduce bus bandwidth between the TP ranks of a stage, bytes/s (effective)."""
    tp_latency_s: float = 20e-6
    overlap: bool = True
    """How an operator's compute and memory times combine: True, the larger of the two (a
    GPU kernel streams its operands while the tensor cores work); False, their sum (a CPU
    core issues loads and FMAs from one instruction stream: the calibration on this machine
    fits the sum, see docs/simulation.md)."""
    threads: int | None = None
    """CPU profiles: the intra-op threads it was measured and fitted with."""

    def __post_init__(self) -> None:
        if self.device_kind not in DEVICE_KINDS:
            raise ConfigError(
                f"profile {self.name!r}: device_kind={self.device_kind!r} must be one of "
                f"{DEVICE_KINDS}"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(
                f"profile {self.name!r}: dtype={self.dtype!r} must be one of {list(DTYPE_BYTES)}"
            )
        for name in ("peak_flops", "memory_bandwidth", "link_bandwidth", "tp_bandwidth"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"profile {self.name!r}: {name} must be > 0")
        for name in (
            "compute_efficiency",
            "memory_efficiency",
            "attention_compute_efficiency",
            "attention_memory_efficiency",
            "memory_utilization",
        ):
            if not 0 < getattr(self, name) <= 1.5:
                raise ConfigError(
                    f"profile {self.name!r}: {name}={getattr(self, name)} must be in (0, 1.5]"
                )
        for name in (
            "step_overhead_s",
            "layer_overhead_s",
            "seq_overhead_s",
            "link_latency_s",
            "tp_latency_s",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"profile {self.name!r}: {name} must be >= 0")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def with_link(
        self, bandwidth: float | None = None, latency_s: float | None = None
    ) -> HardwareProfile:
        """This profile with the stage-to-stage link overridden (None keeps a value)."""
        return dataclasses.replace(
            self,
            link_bandwidth=self.link_bandwidth if bandwidth is None else bandwidth,
            link_latency_s=self.link_latency_s if latency_s is None else latency_s,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_NVLINK4_DIRECTION = 450e9  # 900 GB/s bidirectional (H100 SXM, H200 SXM)
_NVLINK3_DIRECTION = 300e9  # 600 GB/s bidirectional (A100 SXM)
_GB = 10**9

GPU_PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        name="h100",
        description="NVIDIA H100 SXM5 80GB: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3",
        device_kind="cuda",
        dtype="bfloat16",
        peak_flops=989e12,
        memory_bandwidth=3.35e12,
        memory_bytes=80 * _GB,
        link_bandwidth=0.8 * _NVLINK4_DIRECTION,
        tp_bandwidth=0.8 * _NVLINK4_DIRECTION,
    ),
    "h200": HardwareProfile(
        name="h200",
        description="NVIDIA H200 SXM 141GB: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e",
        device_kind="cuda",
        dtype="bfloat16",
        peak_flops=989e12,
        memory_bandwidth=4.8e12,
        memory_bytes=141 * _GB,
        link_bandwidth=0.8 * _NVLINK4_DIRECTION,
        tp_bandwidth=0.8 * _NVLINK4_DIRECTION,
    ),
    "a100": HardwareProfile(
        name="a100",
        description="NVIDIA A100 SXM 80GB: 312 TFLOP/s dense BF16, 2,039 GB/s HBM2e",
        device_kind="cuda",
        dtype="bfloat16",
        peak_flops=312e12,
        memory_bandwidth=2.039e12,
        memory_bytes=80 * _GB,
        link_bandwidth=0.8 * _NVLINK3_DIRECTION,
        tp_bandwidth=0.8 * _NVLINK3_DIRECTION,
    ),
}


def profile_names() -> list[str]:
    """The built-in profiles: the GPUs and, when cpu.json exists, "cpu"."""
    names = sorted(GPU_PROFILES)
    return [*names, "cpu"] if CPU_PROFILE_PATH.is_file() else names


def load_profile(name: str, threads: int | None = None) -> HardwareProfile:
    """A built-in profile by name ("h100", "h200", "a100", "cpu"), or a JSON profile file.

    A file holds one profile's fields, or {"variants": [profile, ...]} with one variant per
    thread count (as cpu.json does); `threads` picks the variant with the most threads not
    above it (the fewest when all are above).

    Raises:
        ConfigError: an unknown name, an unreadable file, or fields out of range.
    """
    if name in GPU_PROFILES:
        return GPU_PROFILES[name]
    path = CPU_PROFILE_PATH if name == "cpu" else Path(name)
    if not path.is_file():
        hint = (
            "run `python -m services.worker.sim.calibrate --write` to create it"
            if name == "cpu"
            else "or give the path of a profile JSON file"
        )
        raise ConfigError(
            f"sim profile {name!r} is unknown: choose one of {profile_names()} ({hint})"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"sim profile {path} is not readable JSON: {exc}") from exc
    variants = raw.get("variants") if isinstance(raw, dict) else None
    return _from_dict(_pick_variant(variants, threads) if variants else raw, str(path))


def _pick_variant(variants: list[dict[str, Any]], threads: int | None) -> dict[str, Any]:
    ranked = sorted(variants, key=lambda v: v.get("threads") or 1)
    if threads is None:
        return ranked[0]
    fitting = [v for v in ranked if (v.get("threads") or 1) <= threads]
    return fitting[-1] if fitting else ranked[0]


def _from_dict(raw: Any, source: str) -> HardwareProfile:
    if not isinstance(raw, dict):
        raise ConfigError(f"sim profile {source} must hold a JSON object")
    known = {f.name for f in dataclasses.fields(HardwareProfile)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"sim profile {source} has unknown fields {unknown}")
    try:
        return HardwareProfile(**raw)
    except TypeError as exc:
        raise ConfigError(f"sim profile {source}: {exc}") from exc


def write_profiles(path: Path, profiles: list[HardwareProfile]) -> None:
    """Write `profiles` as {"variants": [...]} (one per thread count) to `path`."""
    data = {"variants": [p.to_dict() for p in sorted(profiles, key=lambda p: p.threads or 1)]}
    path.write_text(json.dumps(data, indent=2) + "\n")
