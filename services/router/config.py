"""The router's configuration: one validated dataclass, built from CLI flags in one place."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from services.common import limits
from services.common.errors import ConfigError

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000  # the OpenAI-compatible API under `conveyor up`


@dataclass(slots=True)
class RouterConfig:
    """Everything `conveyor router` needs; validated on construction."""

    scheduler_address: str
    """HOST:PORT of the scheduler's gRPC service."""
    model_dir: str
    """Hugging Face model directory: tokenizer files and config.json."""
    port: int = DEFAULT_PORT
    """Public gRPC port."""
    host: str = "[::]"
    """Bind address."""
    served_model_name: str | None = None
    """Name clients use for the model; default: the model directory's name."""
    max_model_len: int | None = None
    """Context length (prompt + output); default: config.json's max_position_embeddings."""
    resume_timeout_s: float = 60.0
    """How long a stream broken by a scheduler restart keeps trying to resume."""
    health_interval_s: float = 1.0
    """How often the scheduler's health is polled."""
    max_stop_strings: int = 16
    """Most stop strings one request may carry (`--max-stop-strings`)."""
    max_stop_string_chars: int = 256
    """Longest stop string, in characters (`--max-stop-string-chars`)."""
    max_prompt_bytes: int = 1 << 20
    """Largest prompt in UTF-8 bytes (text, or a chat's roles and contents), checked before
    the tokenizer runs (`--max-prompt-bytes`)."""
    max_stop_token_ids: int = limits.DEFAULT_MAX_STOP_TOKEN_IDS
    """Most stop token ids one request may carry (`--max-stop-token-ids`)."""
    max_logprobs: int = limits.DEFAULT_MAX_LOGPROBS
    """Largest `logprobs` a request may ask for (`--max-logprobs`)."""
    max_tenant_chars: int = limits.DEFAULT_MAX_TENANT_CHARS
    """Longest tenant name (`--max-tenant-chars`)."""
    max_abs_priority: int = limits.DEFAULT_MAX_ABS_PRIORITY
    """Priority must be in [-N, N] (`--max-abs-priority`)."""
    max_json_bytes: int = 64 << 10
    """Largest KServe `sampling_parameters` JSON, in bytes (`--max-json-bytes`)."""
    max_json_depth: int = 16
    """Deepest nesting of KServe `sampling_parameters` JSON (`--max-json-depth`)."""
    max_message_bytes: int = limits.DEFAULT_MAX_MESSAGE_BYTES
    """Largest gRPC request message; a larger one is RESOURCE_EXHAUSTED
    (`--max-message-bytes`)."""
    max_concurrent_rpcs: int = 1024
    """RPCs served at once (streams included, health checks too); one more is
    RESOURCE_EXHAUSTED (`--max-concurrent-rpcs`)."""
    max_stream_requests: int = 64
    """Requests running at once on one KServe ModelStreamInfer stream; it also bounds the
    stream's response queue (`--max-stream-requests`)."""
    metrics_port: int | None = None
    """Port of the Prometheus endpoint (`--metrics-port`); None: no metrics."""
    otlp_endpoint: str | None = None
    """Where spans go (`--otlp-endpoint`, see services/common/telemetry.py); None: no tracing."""

    # -- security (docs/security.md) ------------------------------------------------------
    api_key_file: str | None = None
    """Key file (`--api-key-file`, lines of `conveyor keys add`): every call needs
    `authorization: Bearer <key>`, and the key sets its principal, tenant and priority
    ceiling; None: no keys (everyone is "anonymous", tenant and priority self-declared)."""
    tls_cert: str | None = None
    """PEM certificate of the public port (`--tls-cert`), also presented to the scheduler
    when it asks for client certificates; None: plaintext."""
    tls_key: str | None = None
    """Its private key (`--tls-key`)."""
    tls_ca: str | None = None
    """PEM CA the scheduler's certificate must chain to (`--tls-ca`): TLS to the scheduler;
    None: plaintext to it."""
    tls_client_ca: str | None = None
    """PEM CA whose client certificates the public port requires (`--tls-client-ca`);
    without API keys the certificate's identity is the principal. None: none asked."""
    internal_token_file: str | None = None
    """File holding the internal token presented to the scheduler (`--internal-token-file`)."""
    internal_token: str | None = field(default=None, repr=False)
    """The internal token: from --internal-token-file, else CONVEYOR_INTERNAL_TOKEN(_FILE)
    (read by the CLI); None: none sent."""
    health_port: int | None = None
    """A plaintext port serving grpc.health.v1 only (`--health-port`); None: none."""
    http_port: int | None = None
    """Port of the OpenAI-compatible HTTP API (`--http-port`), served by this process on
    the same bind address, with the same TLS certificate and API keys; None: no HTTP API."""
    schedulers: list[str] = field(default_factory=list)
    """More pipelines' scheduler addresses (`--schedulers`), docs/scale-out.md."""
    redis_url: str | None = None
    """Redis the schedulers announce themselves in (`--redis-url`); None: no discovery."""
    routing: str = "prefix"
    """`--routing`: prefix, least-load or round-robin (services/router/routing.py)."""
    routing_load_weight: float = 0.5
    """KV blocks of cached prefix one queued request is worth (`--routing-load-weight`)."""

    def __post_init__(self) -> None:
        from services.router.routing import RoutingPolicy

        if not (self.scheduler_address or self.schedulers or self.redis_url):
            raise ConfigError(
                "no scheduler to send requests to: give --scheduler HOST:PORT, --schedulers "
                "A,B,... or --redis-url (pipelines announced there)"
            )
        for address in self.scheduler_addresses:
            if ":" not in address:
                raise ConfigError(f"scheduler address {address!r} must be HOST:PORT")
        if self.redis_url:
            from services.common.redis_url import check_redis_url

            check_redis_url(self.redis_url)
        if self.routing not in {p.value for p in RoutingPolicy}:
            raise ConfigError(
                f"--routing={self.routing!r} is not known: use one of "
                f"{[p.value for p in RoutingPolicy]}"
            )
        if not 0 <= self.routing_load_weight < 1e6:
            raise ConfigError(
                f"--routing-load-weight={self.routing_load_weight} is out of range: [0, 1e6)"
            )
        if not Path(self.model_dir).is_dir():
            raise ConfigError(f"--model={self.model_dir} is not a directory")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port={self.port} is out of range: must be in [1, 65535]")
        for name, value in (
            ("metrics-port", self.metrics_port),
            ("health-port", self.health_port),
            ("http-port", self.http_port),
        ):
            if value is not None and not 0 < value < 65536:
                raise ConfigError(f"--{name}={value} is out of range: must be in [1, 65535]")
        from services.common.credentials import check_tls_files, read_secret

        check_tls_files(self.tls_cert, self.tls_key)
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError(
                "--tls-client-ca needs TLS on the port: give --tls-cert and --tls-key"
            )
        if self.http_port is not None and self.tls_client_ca and not self.api_key_file:
            raise ConfigError(
                "--http-port with --tls-client-ca needs --api-key-file: the HTTP API "
                "authenticates with API keys (it cannot read a client certificate's identity)"
            )
        if self.internal_token is None and self.internal_token_file:
            self.internal_token = read_secret(self.internal_token_file, "--internal-token-file")
        if self.otlp_endpoint:
            from services.common.telemetry import check_endpoint

            check_endpoint(self.otlp_endpoint)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len={self.max_model_len} must be >= 2")
        if self.served_model_name == "":
            raise ConfigError("--served-model-name must not be empty")
        if self.resume_timeout_s < 0 or self.health_interval_s <= 0:
            raise ConfigError("resume timeout must be >= 0 and health interval > 0 seconds")
        self._check_limits()

    def _check_limits(self) -> None:
        for flag, value, low, high in (
            ("--max-stop-strings", self.max_stop_strings, 0, None),
            ("--max-stop-string-chars", self.max_stop_string_chars, 1, None),
            ("--max-prompt-bytes", self.max_prompt_bytes, 1, None),
            ("--max-stop-token-ids", self.max_stop_token_ids, 0, None),
            ("--max-logprobs", self.max_logprobs, 0, None),
            ("--max-tenant-chars", self.max_tenant_chars, 1, None),
            ("--max-abs-priority", self.max_abs_priority, 0, 2**31 - 1),
            ("--max-json-bytes", self.max_json_bytes, 2, None),
            # json's parser recurses once per level: stay well inside Python's stack
            ("--max-json-depth", self.max_json_depth, 1, 256),
            ("--max-message-bytes", self.max_message_bytes, limits.MIN_MESSAGE_BYTES, 2**31 - 1),
            ("--max-concurrent-rpcs", self.max_concurrent_rpcs, 1, None),
            ("--max-stream-requests", self.max_stream_requests, 1, None),
        ):
            if not isinstance(value, int) or value < low or (high is not None and value > high):
                allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
                raise ConfigError(f"{flag}={value!r} is out of range: must be an integer {allowed}")

    @property
    def scheduler_addresses(self) -> list[str]:
        """--scheduler and --schedulers, without repeats."""
        found = [self.scheduler_address] if self.scheduler_address else []
        return list(dict.fromkeys(found + self.schedulers))

    @property
    def request_limits(self) -> limits.RequestLimits:
        """The limits the scheduler enforces too (flags of the same names)."""
        return limits.RequestLimits(
            max_stop_token_ids=self.max_stop_token_ids,
            max_logprobs=self.max_logprobs,
            max_tenant_chars=self.max_tenant_chars,
            max_abs_priority=self.max_abs_priority,
        )

    @property
    def model_name(self) -> str:
        """The served model name."""
        return self.served_model_name or Path(self.model_dir).resolve().name

    def vocab_size(self) -> int:
        """The model's embedding rows (config.json `vocab_size`): token ids must be below it.
        The tokenizer's vocabulary may be smaller or larger."""
        path = Path(self.model_dir) / "config.json"
        try:
            value = int(json.loads(path.read_text())["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"cannot read vocab_size from {path} ({exc}): the workers need it too"
            ) from exc
        if value < 1:
            raise ConfigError(f"{path}: vocab_size={value} must be >= 1")
        return value

    def context_length(self) -> int:
        """--max-model-len, else max_position_embeddings from the model's config.json."""
        path = Path(self.model_dir) / "config.json"
        try:
            model_max = int(json.loads(path.read_text())["max_position_embeddings"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if self.max_model_len is not None:
                return self.max_model_len
            raise ConfigError(
                f"cannot read max_position_embeddings from {path} ({exc}); pass --max-model-len"
            ) from exc
        if self.max_model_len is None:
            return model_max
        if self.max_model_len > model_max:
            raise ConfigError(
                f"--max-model-len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={model_max}"
            )
        return self.max_model_len
