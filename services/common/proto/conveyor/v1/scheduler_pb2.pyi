from services.common.proto.conveyor.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_WAIT: _ClassVar[PauseMode]
    PAUSE_MODE_KEEP: _ClassVar[PauseMode]
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_WAIT: PauseMode
PAUSE_MODE_KEEP: PauseMode
PAUSE_MODE_ABORT: PauseMode

class PauseRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: PauseMode
    def __init__(self, mode: _Optional[_Union[PauseMode, str]] = ...) -> None: ...

class UnpauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseState(_message.Message):
    __slots__ = ("paused", "mode", "num_running", "num_waiting", "num_aborted", "weight_version")
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    mode: PauseMode
    num_running: int
    num_waiting: int
    num_aborted: int
    weight_version: int
    def __init__(self, paused: _Optional[bool] = ..., mode: _Optional[_Union[PauseMode, str]] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_aborted: _Optional[int] = ..., weight_version: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("path", "layers", "recompute_kept", "weight_version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_KEPT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    recompute_kept: bool
    weight_version: int
    def __init__(self, path: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., recompute_kept: _Optional[bool] = ..., weight_version: _Optional[int] = ...) -> None: ...

class UpdateWeightsProgress(_message.Message):
    __slots__ = ("phase", "weight_version", "num_tensors", "pause_s", "stage_s", "commit_s", "total_s")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[UpdateWeightsProgress.Phase]
        PHASE_RECEIVING: _ClassVar[UpdateWeightsProgress.Phase]
        PHASE_DONE: _ClassVar[UpdateWeightsProgress.Phase]
    PHASE_UNSPECIFIED: UpdateWeightsProgress.Phase
    PHASE_RECEIVING: UpdateWeightsProgress.Phase
    PHASE_DONE: UpdateWeightsProgress.Phase
    PHASE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    STAGE_S_FIELD_NUMBER: _ClassVar[int]
    COMMIT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    phase: UpdateWeightsProgress.Phase
    weight_version: int
    num_tensors: int
    pause_s: float
    stage_s: float
    commit_s: float
    total_s: float
    def __init__(self, phase: _Optional[_Union[UpdateWeightsProgress.Phase, str]] = ..., weight_version: _Optional[int] = ..., num_tensors: _Optional[int] = ..., pause_s: _Optional[float] = ..., stage_s: _Optional[float] = ..., commit_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class InitWeightTransferRequest(_message.Message):
    __slots__ = ("master_addr", "master_port", "timeout_s")
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    master_addr: str
    master_port: int
    timeout_s: float
    def __init__(self, master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class InitWeightTransferResponse(_message.Message):
    __slots__ = ("world_size",)
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    def __init__(self, world_size: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "tenant", "weight", "principal", "owner_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    tenant: str
    weight: float
    principal: str
    owner_token: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ..., weight: _Optional[float] = ..., principal: _Optional[str] = ..., owner_token: _Optional[str] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("request_id", "offset", "token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "error", "weight_version", "owner_pipeline_id", "num_spec_steps", "num_spec_draft_tokens", "num_spec_accepted_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_PIPELINE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    offset: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: _common_pb2.FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str
    weight_version: int
    owner_pipeline_id: str
    num_spec_steps: int
    num_spec_draft_tokens: int
    num_spec_accepted_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., offset: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., error: _Optional[str] = ..., weight_version: _Optional[int] = ..., owner_pipeline_id: _Optional[str] = ..., num_spec_steps: _Optional[int] = ..., num_spec_draft_tokens: _Optional[int] = ..., num_spec_accepted_tokens: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "principal", "owner_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    principal: str
    owner_token: str
    def __init__(self, request_id: _Optional[str] = ..., principal: _Optional[str] = ..., owner_token: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("request_id", "from_offset", "principal", "owner_token", "any_submission")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ANY_SUBMISSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    from_offset: int
    principal: str
    owner_token: str
    any_submission: bool
    def __init__(self, request_id: _Optional[str] = ..., from_offset: _Optional[int] = ..., principal: _Optional[str] = ..., owner_token: _Optional[str] = ..., any_submission: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("reset_timelines",)
    RESET_TIMELINES_FIELD_NUMBER: _ClassVar[int]
    reset_timelines: bool
    def __init__(self, reset_timelines: _Optional[bool] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_preempted_total", "num_blocks", "num_free_blocks", "num_cached_blocks", "kv_usage", "fragmentation", "prefix_cache_hit_rate", "num_stages", "serving", "scheduling", "num_inflight", "bubble_fraction", "num_steps", "mean_schedule_us", "request_blocks", "block_size", "not_serving_reason", "cpu_seconds", "paused", "pause_mode", "weight_version", "num_weight_updates", "pipeline_id", "num_prefix_queried_tokens", "num_prefix_hit_tokens", "speculative_config", "num_spec_steps", "num_spec_draft_tokens", "num_spec_accepted_tokens", "spec_acceptance_rate", "spec_mean_accepted_length", "num_draft_calls", "num_draft_failures", "draft_problem", "plan_wait_fraction", "max_inflight", "async_lead", "async_lead_changes")
    class RequestBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_SCHEDULE_US_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NOT_SERVING_REASON_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    PAUSE_MODE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_WEIGHT_UPDATES_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    SPEC_MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_CALLS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBLEM_FIELD_NUMBER: _ClassVar[int]
    PLAN_WAIT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    ASYNC_LEAD_FIELD_NUMBER: _ClassVar[int]
    ASYNC_LEAD_CHANGES_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    num_preempted_total: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    kv_usage: float
    fragmentation: float
    prefix_cache_hit_rate: float
    num_stages: int
    serving: bool
    scheduling: str
    num_inflight: int
    bubble_fraction: _containers.RepeatedScalarFieldContainer[float]
    num_steps: int
    mean_schedule_us: float
    request_blocks: _containers.ScalarMap[str, int]
    block_size: int
    not_serving_reason: str
    cpu_seconds: float
    paused: bool
    pause_mode: PauseMode
    weight_version: int
    num_weight_updates: int
    pipeline_id: str
    num_prefix_queried_tokens: int
    num_prefix_hit_tokens: int
    speculative_config: str
    num_spec_steps: int
    num_spec_draft_tokens: int
    num_spec_accepted_tokens: int
    spec_acceptance_rate: float
    spec_mean_accepted_length: float
    num_draft_calls: int
    num_draft_failures: int
    draft_problem: str
    plan_wait_fraction: _containers.RepeatedScalarFieldContainer[float]
    max_inflight: int
    async_lead: int
    async_lead_changes: int
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_preempted_total: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., kv_usage: _Optional[float] = ..., fragmentation: _Optional[float] = ..., prefix_cache_hit_rate: _Optional[float] = ..., num_stages: _Optional[int] = ..., serving: _Optional[bool] = ..., scheduling: _Optional[str] = ..., num_inflight: _Optional[int] = ..., bubble_fraction: _Optional[_Iterable[float]] = ..., num_steps: _Optional[int] = ..., mean_schedule_us: _Optional[float] = ..., request_blocks: _Optional[_Mapping[str, int]] = ..., block_size: _Optional[int] = ..., not_serving_reason: _Optional[str] = ..., cpu_seconds: _Optional[float] = ..., paused: _Optional[bool] = ..., pause_mode: _Optional[_Union[PauseMode, str]] = ..., weight_version: _Optional[int] = ..., num_weight_updates: _Optional[int] = ..., pipeline_id: _Optional[str] = ..., num_prefix_queried_tokens: _Optional[int] = ..., num_prefix_hit_tokens: _Optional[int] = ..., speculative_config: _Optional[str] = ..., num_spec_steps: _Optional[int] = ..., num_spec_draft_tokens: _Optional[int] = ..., num_spec_accepted_tokens: _Optional[int] = ..., spec_acceptance_rate: _Optional[float] = ..., spec_mean_accepted_length: _Optional[float] = ..., num_draft_calls: _Optional[int] = ..., num_draft_failures: _Optional[int] = ..., draft_problem: _Optional[str] = ..., plan_wait_fraction: _Optional[_Iterable[float]] = ..., max_inflight: _Optional[int] = ..., async_lead: _Optional[int] = ..., async_lead_changes: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("stream_id", "submit", "resume", "abort", "cancel", "traceparent")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    submit: SubmitRequest
    resume: ResumeRequest
    abort: AbortRequest
    cancel: bool
    traceparent: str
    def __init__(self, stream_id: _Optional[int] = ..., submit: _Optional[_Union[SubmitRequest, _Mapping]] = ..., resume: _Optional[_Union[ResumeRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., traceparent: _Optional[str] = ...) -> None: ...

class SessionUpdate(_message.Message):
    __slots__ = ("stream_id", "delta", "status_code", "status_message", "ended")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    delta: TokenDelta
    status_code: int
    status_message: str
    ended: bool
    def __init__(self, stream_id: _Optional[int] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ..., ended: _Optional[bool] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[SessionUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[SessionUpdate, _Mapping]]] = ...) -> None: ...
