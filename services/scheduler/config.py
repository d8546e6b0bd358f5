"""Scheduler configuration: one validated dataclass holding every `conveyor scheduler` flag
with its one default, vLLM's names where the idea is the same.

Some values are the workers' to decide (KV pool size, block size, context length, device):
the flags leave them None and `resolved()` fills them in from what the stages report, once
the pipeline is whole. The planning core (`Scheduler`) only accepts a resolved config.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from services.common import limits
from services.common.errors import ConfigError
from services.scheduler.speculative import SpeculativeConfig


class SchedulingMode(str, enum.Enum):
    """`--scheduling`."""

    ASYNC = "async"
    """Plan a request's next decode before its token came back (stage 0 gets the token
    straight from the last stage)."""
    SYNC = "sync"
    """Wait for the token to come back to the scheduler before planning again."""


class SchedulerPolicy(str, enum.Enum):
    """`--scheduler-policy`: the order of the waiting queue."""

    FCFS = "fcfs"
    PRIORITY = "priority"
    """Lower value first."""
    FAIR = "fair"
    """Weighted fair share of tokens across tenants."""


DEFAULT_PORT = 50060
DEFAULT_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}
"""Token budget of a step when --max-num-batched-tokens is not given, by the stages' device.
On the 2-core CPU, 512 instead of 2048 cut the burst's mean TTFT from 5.6 s to 4.0 s at the
same output throughput (`conveyor bench`, 64 x 128/128, 2 stages)."""


@dataclass(slots=True)
class PipelineInfo:
    """What the stages said about themselves (Describe)."""

    num_stages: int
    num_blocks: int
    """The smallest KV pool over stages: one block id means the same slots everywhere."""
    block_size: int
    max_model_len: int
    vocab_size: int
    model_name: str
    eos_token_ids: list[int]
    device: str = "cpu"
    """"cpu" when any stage computes on a CPU, else the stages' device ("cuda")."""
    weight_versions: list[int] = field(default_factory=list)
    """The version of the weights each stage serves, stage order (UpdateWeights)."""


@dataclass(slots=True)
class SchedulerConfig:
    """Everything `conveyor scheduler` needs. Built once from CLI flags and passed down.

    Every field is validated in `__post_init__`; a bad value raises `ConfigError` naming the
    value and the allowed range.
    """

    # -- planning -------------------------------------------------------------------------
    num_blocks: int | None = None
    """KV blocks in the pool, from the workers (the smallest stage decides). One block id
    names the same slots on every stage."""
    block_size: int | None = None
    """Tokens per KV block (`--block-size`); None: the workers'. When set it must equal
    theirs."""
    max_num_seqs: int = 256
    """Most requests in one step (one micro-batch) (`--max-num-seqs`)."""
    max_num_batched_tokens: int | None = None
    """Most tokens computed in one step: decodes count 1, prefill chunks their length
    (`--max-num-batched-tokens`); None: by the stages' device (DEFAULT_BATCHED_TOKENS), and
    at least max_model_len when prefill is not chunked."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output) (`--max-model-len`); None: the workers'. It may
    only lower theirs."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes (`--enable-prefix-caching`)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps under the token budget (`--enable-chunked-prefill`)."""
    policy: SchedulerPolicy = SchedulerPolicy.FAIR
    """Waiting-queue order (`--scheduler-policy`). `fair` by default: with one tenant it is
    arrival order, with several a tenant flooding the queue cannot starve the others."""
    scheduling: SchedulingMode = SchedulingMode.ASYNC
    """`--scheduling`."""
    num_stages: int = 1
    """Pipeline stages P, from the workers: a request that sampled at step s is scheduled
    again at step s + P at the earliest."""
    max_inflight: int | None = None
    """Steps in flight, fixed (`--max-inflight`); None: P in sync mode, and in async mode
    P + a lead that adapts to stage 0's plan waits (services/scheduler/lead.py)."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (`--speculative-config`, docs/speculative-decoding.md); None:
    one token per decoding step."""
    draft_worker: str | None = None
    """HOST:PORT of the draft worker (`--draft-worker`), needed by a `draft_model`
    speculative config and by nothing else."""
    max_waiting: int = 10_000
    """Most requests waiting in the queue; one more raises `QueueFull` (`--max-waiting`)."""
    orphan_timeout_s: float = 5.0
    """A request nobody listens to (its router or client went away, or it was recovered
    after a restart and no router resumed it) is aborted after this many seconds
    (`--orphan-timeout`)."""
    step_timeout_s: float = 60.0
    """Steps in flight and none finished for this long: a stage is hung (a stopped process,
    a wedged kernel or collective) or the step is too long for it. The pipeline is re-formed
    and the oldest step's requests run alone; one that times out alone is failed
    (`--step-timeout`; vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S, 60 s, does the same)."""
    store_grace_s: float = 3.0
    """Redis write failures shorter than this are ridden out (tokens stay buffered); longer
    ones turn health NOT_SERVING and refuse new requests (`--store-grace`)."""

    # -- limits on what a Submit may carry (services/scheduler/validation.py) -------------
    max_stop_token_ids: int = limits.DEFAULT_MAX_STOP_TOKEN_IDS
    """Most stop token ids in one request (`--max-stop-token-ids`)."""
    max_logprobs: int = limits.DEFAULT_MAX_LOGPROBS
    """Largest `logprobs` a request may ask for (`--max-logprobs`)."""
    max_tenant_chars: int = limits.DEFAULT_MAX_TENANT_CHARS
    """Longest tenant name (`--max-tenant-chars`)."""
    max_abs_priority: int = limits.DEFAULT_MAX_ABS_PRIORITY
    """Priority must be in [-N, N] (`--max-abs-priority`)."""
    max_message_bytes: int = limits.DEFAULT_MAX_MESSAGE_BYTES
    """Largest gRPC request message; a larger one is RESOURCE_EXHAUSTED
    (`--max-message-bytes`)."""

    # -- the service ----------------------------------------------------------------------
    workers: list[str] = field(default_factory=list)
    """Stage worker addresses HOST:PORT in stage order (`--workers`); with T tensor-parallel
    ranks per stage, stages x ranks of them, stage-major."""
    redis_url: str | None = None
    """Redis holding request state (`--redis-url`); None: a private redis-server whose
    state does not outlive this process."""
    host: str = "[::]"
    """gRPC bind address (`--host`)."""
    port: int = DEFAULT_PORT
    """gRPC port (`--port`)."""
    finished_ttl_s: int = 3600
    """Seconds a finished request stays readable in Redis (`--finished-ttl`)."""
    metrics_port: int | None = None
    """Prometheus endpoint port (`--metrics-port`); None: no metrics."""
    otlp_endpoint: str | None = None
    """Where spans go (`--otlp-endpoint`); None: no tracing."""
    trace_scheduler: str | None = None
    """File the event trace (JSON lines) is appended to (`--trace-scheduler`)."""
    timeline: str | None = None
    """File the stages' Chrome/Perfetto trace is written to on stop (`--timeline`)."""

    # -- security (docs/security.md) ------------------------------------------------------
    tls_cert: str | None = None
    """PEM certificate served on the port and presented to the workers (`--tls-cert`);
    None: plaintext."""
    tls_key: str | None = None
    """Its private key (`--tls-key`)."""
    tls_ca: str | None = None
    """PEM CA (`--tls-ca`): callers must present a client certificate it signed, and the
    workers' certificates must chain to it (mutual TLS); None: no client certificates."""
    internal_token_file: str | None = None
    """File holding the internal token (`--internal-token-file`)."""
    internal_token: str | None = field(default=None, repr=False)
    """The internal token: callers must present it, and it is sent to the workers. From
    --internal-token-file, else CONVEYOR_INTERNAL_TOKEN(_FILE) (read by the CLI); None:
    callers are not authenticated."""
    health_port: int | None = None
    """A plaintext port serving grpc.health.v1 only (`--health-port`), for probes that
    cannot speak TLS; None: none."""

    # -- many pipelines (docs/scale-out.md) -----------------------------------------------
    pipeline_id: str = ""
    """This pipeline's name among those sharing one Redis (`--pipeline-id`): it owns its
    requests, announces itself to the routers and adopts the requests of a lost pipeline.
    Empty: a lone pipeline (no announcement, no adoption)."""
    advertise_address: str | None = None
    """HOST:PORT routers reach this scheduler at, as announced (`--advertise-address`);
    None: 127.0.0.1 and --port."""
    announce_ttl_s: float = 3.0
    """The announcement expires after this many seconds unless renewed (renewed every
    third of it); an expired one means the scheduler is gone (`--announce-ttl`)."""
    adopt_grace_s: float = 10.0
    """A pipeline NOT_SERVING for longer than this is lost: another adopts its unfinished
    requests (`--adopt-grace`)."""
    announce_max_blocks: int = 4096
    """Most cached block hashes one announcement carries, the most recent first
    (`--announce-max-blocks`)."""

    def __post_init__(self) -> None:
        self.policy = _enum(SchedulerPolicy, self.policy, "policy")
        self.scheduling = _enum(SchedulingMode, self.scheduling, "scheduling")
        if isinstance(self.speculative, str):
            self.speculative = SpeculativeConfig.from_json(self.speculative)
        uses_draft = self.speculative is not None and self.speculative.uses_draft_model
        if uses_draft and not self.draft_worker:
            raise ConfigError(
                'a "draft_model" --speculative-config needs --draft-worker HOST:PORT, the '
                "address of a `conveyor worker --draft` (conveyor up starts one)"
            )
        if self.draft_worker and not uses_draft:
            raise ConfigError(
                '--draft-worker is used by a "draft_model" --speculative-config only, e.g. '
                '\'{"model": DIR, "num_speculative_tokens": 4}\''
            )
        for name, low in (
            ("num_blocks", 1),
            ("block_size", 1),
            ("max_num_batched_tokens", 1),
            ("max_model_len", 2),
            ("max_inflight", 1),
        ):
            value = getattr(self, name)
            if value is not None:
                _at_least(name, value, low)
        _at_least("max_num_seqs", self.max_num_seqs, 1)
        _at_least("num_stages", self.num_stages, 1)
        _at_least("max_waiting", self.max_waiting, 1)
        _at_least("finished_ttl_s", self.finished_ttl_s, 1)
        for name in ("max_stop_token_ids", "max_logprobs", "max_abs_priority"):
            _at_least(name, getattr(self, name), 0)
        _at_least("max_tenant_chars", self.max_tenant_chars, 1)
        _at_least("max_message_bytes", self.max_message_bytes, limits.MIN_MESSAGE_BYTES)
        if self.max_message_bytes > 2**31 - 1 or self.max_abs_priority > 2**31 - 1:
            raise ConfigError(
                "max_message_bytes and max_abs_priority must be below 2^31 (gRPC and proto "
                f"int32 bounds): got {self.max_message_bytes} and {self.max_abs_priority}"
            )
        if self.redis_url:
            from services.common.redis_url import check_redis_url

            check_redis_url(self.redis_url)
        if self.pipeline_id:
            from services.common.pipelines import check_pipeline_id

            check_pipeline_id(self.pipeline_id)
        if self.advertise_address is not None and ":" not in self.advertise_address:
            raise ConfigError(f"advertise_address {self.advertise_address!r} must be HOST:PORT")
        _at_least("announce_max_blocks", self.announce_max_blocks, 0)
        for name in (
            "orphan_timeout_s",
            "step_timeout_s",
            "store_grace_s",
            "announce_ttl_s",
            "adopt_grace_s",
        ):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name}={value!r} is out of range: must be > 0 seconds")
        for name in ("port", "metrics_port", "health_port"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 65536:
                raise ConfigError(f"{name}={value} is out of range: must be in [1, 65535]")
        from services.common.credentials import read_secret
        from services.common.security import check_internal_tls

        check_internal_tls(self.tls_cert, self.tls_key, self.tls_ca)
        if self.internal_token is None and self.internal_token_file:
            self.internal_token = read_secret(self.internal_token_file, "--internal-token-file")
        for address in self.workers:
            if ":" not in address:
                raise ConfigError(f"worker address {address!r} must be HOST:PORT")
        if self.draft_worker is not None and ":" not in self.draft_worker:
            raise ConfigError(f"draft worker address {self.draft_worker!r} must be HOST:PORT")
        if self.otlp_endpoint:
            from services.common.telemetry import check_endpoint

            check_endpoint(self.otlp_endpoint)
        if self.is_resolved:
            self._check_geometry()

    def _check_geometry(self) -> None:
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ConfigError(
                f"num_blocks={self.num_blocks} x block_size={self.block_size} = "
                f"{self.num_blocks * self.block_size} KV slots cannot hold one sequence of "
                f"max_model_len={self.max_model_len}: give the KV cache more memory or lower "
                "--max-model-len"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len="
                f"{self.max_model_len} with chunked prefill off: long prompts could never be "
                "scheduled; raise --max-num-batched-tokens or enable chunked prefill"
            )

    @property
    def request_limits(self) -> limits.RequestLimits:
        """The bounds every Submit is checked against (the router's flags of the same
        names)."""
        return limits.RequestLimits(
            max_stop_token_ids=self.max_stop_token_ids,
            max_logprobs=self.max_logprobs,
            max_tenant_chars=self.max_tenant_chars,
            max_abs_priority=self.max_abs_priority,
        )

    @property
    def is_async(self) -> bool:
        return self.scheduling is SchedulingMode.ASYNC

    @property
    def is_resolved(self) -> bool:
        """Whether every value the workers decide is known (the core needs them)."""
        return None not in (
            self.num_blocks,
            self.block_size,
            self.max_model_len,
            self.max_num_batched_tokens,
        )

    @property
    def steps_in_flight(self) -> int:
        """--max-inflight, else P + 1 (async) or P (sync): the window of a scheduler's first session.

        Async plans each micro-batch's next step one step before it is due: when step s
        reports, step s + P + 1 is planned, while stage 0 still has step s + 1's tokens to
        wait for. One step of lead hides the control plane's round trip whenever that is
        shorter than a stage step; each step more adds a stage step to the wait of a request
        that arrives while the pipeline is busy (docs/performance.md#steps-in-flight). Without
        --max-inflight the service grows the lead while stage 0 waits for plans the window
        held back, and shrinks it again after a quiet stretch; a later session keeps the lead
        learned (services/scheduler/lead.py)."""
        if self.max_inflight:
            return self.max_inflight
        return self.num_stages + 1 if self.is_async else self.num_stages

    def resolved(self, info: PipelineInfo) -> SchedulerConfig:
        """This config with the workers' values filled in; raises ConfigError where a flag
        contradicts them."""
        if self.block_size is not None and self.block_size != info.block_size:
            raise ConfigError(
                f"--block-size={self.block_size} but the workers use {info.block_size}: "
                "drop the flag or start the workers with the same --block-size"
            )
        max_model_len = min(self.max_model_len or info.max_model_len, info.max_model_len)
        budget = DEFAULT_BATCHED_TOKENS.get(info.device, 2048)
        if not self.enable_chunked_prefill:
            budget = max(budget, max_model_len)
        return replace(
            self,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            max_model_len=max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens or budget,
            num_stages=info.num_stages,
        )


def _enum(cls: type[enum.Enum], value, name: str):
    try:
        return cls(value)
    except ValueError:
        allowed = [m.value for m in cls]
        raise ConfigError(f"{name}={value!r} is not known: use one of {allowed}") from None


def _at_least(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or value < low:
        raise ConfigError(f"{name}={value!r} is out of range: must be an integer >= {low}")
