"""`WorkerConfig`: everything one stage worker needs, validated once, passed down explicitly."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from services.common.affinity import default_threads
from services.common.config import default_of, parse_addr
from services.common.errors import ConfigError, ModelLoadError
from services.common.units import format_bytes, parse_bytes
from services.worker.model.stages import MAX_STAGES

MAX_TENSOR_PARALLEL = 64  # the same bound as model/tensor_parallel.py (no torch import here)

# What the flags may say. Light on purpose (no torch): the CLI builds its parser from here.
DEFAULT_PORT = 50061
DEVICES = ("cpu", "cuda", "sim")
"""`--device`: sim models the forward pass instead of running it (services/worker/sim/)."""
DTYPES = ("float32", "bfloat16", "float16")
BLOCK_SIZES = (8, 16, 32)
ATTENTION_BACKENDS = ("cpu", "torch", "triton")
QUANTIZATIONS = ("int8", "fp8")
"""`--quantization`: weight-only, per output channel (services/worker/model/quant.py)."""
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""What `--quantization-ignore` may name (model/quant.py keeps the same list)."""
LINEAR_BACKENDS = ("auto", "onednn", "torch")
"""`--linear-backend`: auto = oneDNN where supported (CPU, float32/bfloat16), else torch."""


def parse_projections(text: str | None) -> tuple[str, ...] | None:
    """`--quantization-ignore`: "down_proj,o_proj" -> the names; "none" -> (); None stays
    None (the method's default). WorkerConfig checks the names."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    return tuple(name.strip() for name in text.split(",") if name.strip())


def parse_layer_split(text: str | None) -> list[int] | None:
    """`--layer-split`: "10,10,10" -> [10, 10, 10]; None stays None (an even split)."""
    if text is None:
        return None
    try:
        return [int(count) for count in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"--layer-split={text!r} is not a list of layer counts: use e.g. 15,15"
        ) from None


SIM_FLAGS = {
    "sim_profile": "--sim-profile",
    "sim_link_bandwidth": "--sim-link-bandwidth",
    "sim_link_latency": "--sim-link-latency",
    "sim_tensor_parallel_size": "--sim-tensor-parallel-size",
}
"""The fields only `--device sim` reads, and their flags."""


def check_no_sim_flags(values: object, device: str) -> None:
    """A --sim-* flag on a real device would be ignored: say so instead (`values`: a
    WorkerConfig, or `conveyor up`'s arguments). A flag given with its default value cannot
    be told apart from an absent one, and changes nothing."""
    for name, flag in SIM_FLAGS.items():
        if getattr(values, name) != default_of(WorkerConfig, name):
            raise ConfigError(f"{flag} needs --device sim (device={device!r})")


@dataclass(slots=True)
class WorkerConfig:
    """Configuration of one pipeline stage worker (CLI flags keep vLLM's names)."""

    model_dir: str
    """HF model directory: config.json + model.safetensors (or a sharded index)."""
    stage_index: int = 0
    """Which stage this worker runs, 0 .. num_stages - 1."""
    num_stages: int = 1
    """`--pipeline-parallel-size` / `--stages`, 1 .. 8."""
    tp_rank: int = 0
    """`--tp-rank`: this worker's tensor-parallel rank inside its stage, 0 .. T - 1."""
    tensor_parallel_size: int = 1
    """`--tensor-parallel-size`: ranks per stage (T), 1 .. 64; each holds 1/T of the stage's
    weights and KV heads (model/tensor_parallel.py)."""
    layer_split: list[int] | None = None
    """Layers per stage, e.g. [10, 10, 10]; None splits evenly (see model/stages.py)."""
    block_size: int = 16
    """`--block-size`: tokens per KV block, one of 8, 16, 32."""
    kv_cache_memory: int | str = "1GiB"
    """`--kv-cache-memory`: bytes for this stage's KV cache (e.g. "512MiB"); parsed to int."""
    max_model_len: int | None = None
    """`--max-model-len`: longest sequence; None means the model's max_position_embeddings."""
    dtype: str = "float32"
    """`--dtype`: float32 or bfloat16 (float16 on CUDA)."""
    attention_backend: str | None = None
    """"cpu" (C++ decode kernel), "torch" (plain PyTorch, the reference) or "triton" (CUDA);
    None: triton on CUDA, on CPU the C++ kernel when it builds here, else torch
    (`effective_attention_backend`)."""
    device: str = "cpu"
    """`--device`: cpu, cuda, or sim (a simulated device: every real part of the worker, the
    forward pass replaced by a timing model; docs/simulation.md)."""
    num_threads: int | None = None
    """`--threads`: torch intra-op threads on CPU; None: this machine's cores / stages."""
    quantization: str | None = None
    """`--quantization`: "int8" or "fp8" weights for the decoder layers' linears, quantized
    per output channel at load; None: the checkpoint's own (FP8 checkpoints stay FP8),
    else unquantized. Embeddings, norms and the logits stay in `dtype`."""
    quantization_ignore: tuple[str, ...] | None = None
    """`--quantization-ignore`: decoder projections kept in `dtype` (names of PROJECTIONS);
    None: the method's default (fp8: down_proj, int8: none; FP8 checkpoints: none)."""
    linear_backend: str = "auto"
    """`--linear-backend`: matmuls on "onednn" (packed weights, CPU) or plain "torch";
    "auto" takes oneDNN wherever it is supported, and on CPU runs matmuls of 1-4 rows (decode
    steps of a few requests) on the streaming kernel of model/cpu_ops.py."""
    host: str = "[::]"
    """`--host`: gRPC bind address."""
    port: int = DEFAULT_PORT
    """`--port`: gRPC port."""
    dist_addr: str = "127.0.0.1:29500"
    """`--dist-addr`: the torch.distributed rendezvous HOST:PORT, hosted by stage 0."""
    cpu_affinity: list[int] | None = None
    """`--cpu-affinity`: cores this worker is pinned to; None: not pinned."""
    seed: int | None = None
    """`--seed`: seed of unseeded random sampling; None: from the OS."""
    metrics_port: int | None = None
    """`--metrics-port`: Prometheus endpoint port; None: no metrics."""
    otlp_endpoint: str | None = None
    """`--otlp-endpoint`: where spans go; None: no tracing."""
    tls_cert: str | None = None
    """`--tls-cert`: PEM certificate served on the gRPC port; None: plaintext."""
    tls_key: str | None = None
    """`--tls-key`: its private key."""
    tls_ca: str | None = None
    """`--tls-ca`: callers (the scheduler, operators) need a client certificate this CA
    signed (mutual TLS); None: none asked."""
    internal_token_file: str | None = None
    """`--internal-token-file`: file holding the internal token."""
    internal_token: str | None = field(default=None, repr=False)
    """The internal token: callers must present it, and it signs the rendezvous. From
    --internal-token-file, else CONVEYOR_INTERNAL_TOKEN(_FILE) (read by the CLI); None:
    callers are not authenticated."""
    health_port: int | None = None
    """`--health-port`: a plaintext port serving grpc.health.v1 only (probes that cannot
    speak TLS); None: none."""
    sim_profile: str = "h200"
    """`--sim-profile`, device sim: the modeled hardware, "h100", "h200", "a100", "cpu" (this
    machine, fitted) or a profile JSON file."""
    sim_link_bandwidth: float | None = None
    """`--sim-link-bandwidth`, device sim: stage-to-stage bandwidth in GB/s (1e9 bytes/s);
    None: the profile's."""
    sim_link_latency: float | None = None
    """`--sim-link-latency`, device sim: stage-to-stage latency in microseconds; None: the
    profile's."""
    sim_tensor_parallel_size: int = 1
    """`--sim-tensor-parallel-size`, device sim: modeled TP ranks per stage (weights, FLOPs
    and KV split over them, plus an all-reduce per attention and MLP block)."""
    is_draft: bool = False
    """`--draft`: serve the whole model as the draft worker of speculative decoding (the
    DraftWorker service, docs/speculative-decoding.md), not a pipeline stage."""
    record_plans: str | None = None
    """`--record-plans FILE`: write every plan this stage receives there (plan_record.py)."""
    hang_timeout_s: float = 600.0
    """`--hang-timeout`: a step computing longer than this ends the process (exit code
    `HUNG_EXIT`), so that its supervisor starts a fresh one; 0: never."""

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
        if not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL:
            raise ConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size} is out of range: must be "
                f"in [1, {MAX_TENSOR_PARALLEL}]"
            )
        if not 0 <= self.tp_rank < self.tensor_parallel_size:
            raise ConfigError(
                f"tp_rank={self.tp_rank} is out of range: must be in "
                f"[0, {self.tensor_parallel_size - 1}] (tensor_parallel_size="
                f"{self.tensor_parallel_size})"
            )
        if self.is_draft and (
            self.num_stages > 1 or self.tensor_parallel_size > 1 or self.device == "sim"
        ):
            raise ConfigError(
                "--draft runs the whole draft model in one process on a real device: it takes "
                "neither --stages, --tensor-parallel-size nor --device sim"
            )
        if self.tensor_parallel_size > 1 and self.device == "sim":
            raise ConfigError(
                "tensor_parallel_size > 1 runs real ranks; a simulated stage models them with "
                "--sim-tensor-parallel-size instead"
            )
        if self.tensor_parallel_size > 1:
            from services.worker.model.config import ModelConfig
            from services.worker.model.tensor_parallel import check_tensor_parallel

            try:
                model = ModelConfig.from_dir(self.model_dir)
            except ModelLoadError as exc:
                raise ConfigError(str(exc)) from exc
            check_tensor_parallel(model, self.tensor_parallel_size, source=self.model_dir)
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
                f"dtype={self.dtype!r} is not supported: choose one of {list(DTYPES)}"
            )
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend={self.attention_backend!r} is unknown: choose one of "
                f"{sorted(ATTENTION_BACKENDS)}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads={self.num_threads} must be >= 1")
        if not self.hang_timeout_s >= 0:
            raise ConfigError(
                f"hang_timeout_s={self.hang_timeout_s} must be >= 0 (seconds; 0: never)"
            )
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r} is not supported: use one of {DEVICES}")
        for name in ("port", "metrics_port", "health_port"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 65536:
                raise ConfigError(f"{name}={value} is out of range: must be in [1, 65535]")
        parse_addr(self.dist_addr, "--dist-addr")
        from services.common.credentials import read_secret
        from services.common.security import check_internal_tls

        check_internal_tls(self.tls_cert, self.tls_key, self.tls_ca)
        if self.internal_token is None and self.internal_token_file:
            self.internal_token = read_secret(self.internal_token_file, "--internal-token-file")
        if self.otlp_endpoint:
            from services.common.telemetry import check_endpoint

            check_endpoint(self.otlp_endpoint)
        if self.device == "sim":
            self._check_sim()
        else:
            check_no_sim_flags(self, self.device)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization={self.quantization!r} is unknown: choose one of "
                f"{list(QUANTIZATIONS)}"
            )
        unknown = set(self.quantization_ignore or ()) - set(PROJECTIONS)
        if unknown:
            raise ConfigError(
                f"quantization_ignore names {sorted(unknown)}: choose among {list(PROJECTIONS)}"
            )
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ConfigError(
                f"linear_backend={self.linear_backend!r} is unknown: choose one of "
                f"{list(LINEAR_BACKENDS)}"
            )
        if self.linear_backend == "onednn" and not _onednn_supported(self.device, self.dtype):
            raise ConfigError(
                f"linear_backend='onednn' needs a CPU device, float32 or bfloat16 and a torch "
                f"built with oneDNN (device={self.device!r}, dtype={self.dtype!r}); use "
                f"--linear-backend torch"
            )
        if self.quantization_ignore is not None and self.quantization is None:
            self._check_quantization_ignore()
        if self.max_model_len is not None:
            self._check_max_model_len()
        self._check_device()

    def _check_device(self) -> None:
        """What this machine and --device allow: refused here, before anything is loaded or
        allocated, rather than as a traceback (or a worker that fails every request)."""
        backend = self.attention_backend
        if backend == "triton" and self.device != "cuda":
            raise ConfigError(
                f"--attention-backend triton needs --device cuda (device={self.device!r}); "
                "on CPU use cpu or torch"
            )
        if backend == "cpu" and self.device != "cpu":
            raise ConfigError(
                f"--attention-backend cpu needs --device cpu (device={self.device!r}); "
                "on CUDA use triton or torch"
            )
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(
                    f"--device cuda: no CUDA device here (torch {torch.__version__}, "
                    f"{torch.cuda.device_count()} GPUs seen); use --device cpu"
                )
        if self.device == "cpu":
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            if self.kv_cache_memory > memory:
                raise ConfigError(
                    f"--kv-cache-memory={format_bytes(self.kv_cache_memory)} is more than this "
                    f"machine's memory ({format_bytes(memory)}): lower it"
                )

    def _check_quantization_ignore(self) -> None:
        """--quantization-ignore without --quantization means something for an FP8
        checkpoint only (the projections it keeps in --dtype); elsewhere it is ignored."""
        from services.worker.model.quant import checkpoint_quantization

        try:
            checkpoint = checkpoint_quantization(self.model_dir)
        except ModelLoadError as exc:
            raise ConfigError(str(exc)) from exc
        if checkpoint is None:
            raise ConfigError(
                "--quantization-ignore needs --quantization (int8 or fp8): "
                f"{self.model_dir} is not a quantized checkpoint"
            )

    def _check_max_model_len(self) -> None:
        """The router's rule: no context longer than the model's (its position embeddings;
        a longer one would also size the rotary tables and KV cache for it)."""
        from services.worker.model.config import ModelConfig

        try:
            model_max = ModelConfig.from_dir(self.model_dir).max_position_embeddings
        except ModelLoadError as exc:
            raise ConfigError(str(exc)) from exc
        if self.max_model_len > model_max:
            raise ConfigError(
                f"--max-model-len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={model_max}"
            )

    def _check_sim(self) -> None:
        from services.worker.sim.profiles import load_profile

        load_profile(self.sim_profile, self.threads)  # raises ConfigError naming the choices
        if self.sim_link_bandwidth is not None and not self.sim_link_bandwidth > 0:
            raise ConfigError(f"sim_link_bandwidth={self.sim_link_bandwidth} must be > 0 GB/s")
        if self.sim_link_latency is not None and not self.sim_link_latency >= 0:
            raise ConfigError(f"sim_link_latency={self.sim_link_latency} must be >= 0 us")
        if not 1 <= self.sim_tensor_parallel_size <= 64:
            raise ConfigError(
                f"sim_tensor_parallel_size={self.sim_tensor_parallel_size} is out of range: "
                "must be in [1, 64]"
            )

    @property
    def threads(self) -> int:
        """torch intra-op threads: --threads, else `default_threads` (a CPU quota, or the
        cores over stages x ranks)."""
        return self.num_threads or default_threads(self.num_stages * self.tensor_parallel_size)

    @property
    def num_ranks(self) -> int:
        """Processes in the pipeline: stages x tensor-parallel ranks."""
        return self.num_stages * self.tensor_parallel_size

    @property
    def global_rank(self) -> int:
        """This process's rank in the pipeline's group: stage-major, then tp rank."""
        return self.stage_index * self.tensor_parallel_size + self.tp_rank

    @property
    def rank_device(self) -> str:
        """Where this rank computes: on CUDA with T > 1, GPU `tp_rank` when this process sees
        the stage's T GPUs (one host or container holding them), else the one it sees (a
        container given one GPU each); otherwise `device`."""
        if self.device == "cuda" and self.tensor_parallel_size > 1:
            import torch

            return f"cuda:{self.tp_rank % max(torch.cuda.device_count(), 1)}"
        return self.device

    @property
    def effective_attention_backend(self) -> str:
        """--attention-backend, else the device's default (see `attention_backend`)."""
        from services.worker.model.llama import default_attention_backend

        return self.attention_backend or default_attention_backend(self.device)

    @property
    def uses_cpu_kernels(self) -> bool:
        """Whether the C++ CPU kernels of model/cpu_ops.py run: matmuls of 1-4 rows on
        `small_linear` beside oneDNN, and each layer's elementwise work fused. On CPU with
        --linear-backend auto; `onednn` keeps every matmul on oneDNN and the elementwise
        work in eager PyTorch (the path before them, for comparisons)."""
        return self.linear_backend == "auto" and self.device == "cpu"

    @property
    def uses_onednn(self) -> bool:
        """Whether the matmuls run on oneDNN (resolves "auto")."""
        if self.linear_backend == "torch":
            return False
        return _onednn_supported(self.device, self.dtype)


def _onednn_supported(device: str, dtype: str) -> bool:
    if device == "sim":  # nothing is computed
        return False
    from services.worker.model.loader import resolve_dtype
    from services.worker.model.packed_linear import onednn_supported

    return onednn_supported(device, resolve_dtype(dtype))
