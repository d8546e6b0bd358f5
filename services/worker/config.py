"""`WorkerConfig`: everything one stage worker needs, validated once, passed down explicitly."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import ConfigError
from services.common.units import parse_bytes
from services.worker.kv_cache import BLOCK_SIZES
from services.worker.model.llama import ATTENTION_BACKENDS
from services.worker.model.loader import DTYPES, resolve_dtype
from services.worker.model.packed_linear import LINEAR_BACKENDS, onednn_supported
from services.worker.model.stages import MAX_STAGES


@dataclass(slots=True)
class WorkerConfig:
    """Configuration of one pipeline stage worker (CLI flags keep vLLM's names)."""

    model_dir: str
    """HF model directory: config.json + model.safetensors (or a sharded index)."""
    stage_index: int = 0
    """Which stage this worker runs, 0 .. num_stages - 1."""
    num_stages: int = 1
    """`--pipeline-parallel-size` / `--stages`, 1 .. 8."""
    layer_split: list[int] | None = None
    """Layers per stage, e.g. [10, 10, 10]; None splits evenly (see model/stages.py)."""
    block_size: int = 16
    """`--block-size`: tokens per KV block, one of 8, 16, 32."""
    kv_cache_memory: int | str = "2GiB"
    """`--kv-cache-memory`: bytes for this stage's KV cache (e.g. "2GiB"); parsed to int."""
    max_model_len: int | None = None
    """`--max-model-len`: longest sequence; None means the model's max_position_embeddings."""
    dtype: str = "float32"
    """`--dtype`: float32 or bfloat16 (float16 on CUDA)."""
    attention_backend: str = "torch"
    """"cpu" (C++ decode kernel), "torch" (plain PyTorch, the reference) or "triton" (CUDA)."""
    device: str = "cpu"
    num_threads: int | None = None
    """torch intra-op threads on CPU; None leaves torch's default."""
    linear_backend: str = "auto"
    """`--linear-backend`: matmuls on "onednn" (packed weights, CPU) or plain "torch";
    "auto" takes oneDNN wherever it is supported."""

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        if not 1 <= self.num_stages <= MAX_STAGES:
            raise ConfigError(
                f"num_stages={self.num_stages} is out of range: must be in [1, {MAX_STAGES}]"
            )
        if not 0 <= self.stage_index < self.num_stages:
            raise ConfigError(
                f"stage_index={self.stage_index} is out of range: must be in "
                f"[0, {self.num_stages - 1}]"
            )
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(
                f"block_size={self.block_size} is not supported: use one of {BLOCK_SIZES}"
            )
        if self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory={self.kv_cache_memory} must be > 0 bytes")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len={self.max_model_len} must be >= 1")
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"dtype={self.dtype!r} is not supported: choose one of {sorted(DTYPES)}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend={self.attention_backend!r} is unknown: choose one of "
                f"{sorted(ATTENTION_BACKENDS)}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads={self.num_threads} must be >= 1")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ConfigError(
                f"linear_backend={self.linear_backend!r} is unknown: choose one of "
                f"{list(LINEAR_BACKENDS)}"
            )
        if self.linear_backend == "onednn" and not onednn_supported(
            self.device, resolve_dtype(self.dtype)
        ):
            raise ConfigError(
                f"linear_backend='onednn' needs a CPU device, float32 or bfloat16 and a torch "
                f"built with oneDNN (device={self.device!r}, dtype={self.dtype!r}); use "
                f"--linear-backend torch"
            )

    @property
    def uses_onednn(self) -> bool:
        """Whether the matmuls run on oneDNN (resolves "auto")."""
        if self.linear_backend == "torch":
            return False
        return onednn_supported(self.device, resolve_dtype(self.dtype))
