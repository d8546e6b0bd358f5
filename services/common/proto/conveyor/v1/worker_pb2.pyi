from services.common.proto.conveyor.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StageTransferRequest(_message.Message):
    __slots__ = ("master_addr", "master_port", "rank", "world_size", "timeout_s")
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    master_addr: str
    master_port: int
    rank: int
    world_size: int
    timeout_s: float
    def __init__(self, master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class StageTransferResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageWeightsRequest(_message.Message):
    __slots__ = ("path", "layers", "weight_version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    weight_version: int
    def __init__(self, path: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class StageWeightsReply(_message.Message):
    __slots__ = ("phase", "num_tensors")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[StageWeightsReply.Phase]
        PHASE_ACCEPTED: _ClassVar[StageWeightsReply.Phase]
        PHASE_STAGED: _ClassVar[StageWeightsReply.Phase]
    PHASE_UNSPECIFIED: StageWeightsReply.Phase
    PHASE_ACCEPTED: StageWeightsReply.Phase
    PHASE_STAGED: StageWeightsReply.Phase
    PHASE_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    phase: StageWeightsReply.Phase
    num_tensors: int
    def __init__(self, phase: _Optional[_Union[StageWeightsReply.Phase, str]] = ..., num_tensors: _Optional[int] = ...) -> None: ...

class CommitWeightsRequest(_message.Message):
    __slots__ = ("weight_version", "discard")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DISCARD_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    discard: bool
    def __init__(self, weight_version: _Optional[int] = ..., discard: _Optional[bool] = ...) -> None: ...

class CommitWeightsResponse(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    def __init__(self, weight_version: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "sampling", "block_ids", "num_computed_tokens", "num_scheduled_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling: _common_pb2.SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("request_id", "num_scheduled_tokens", "new_block_ids", "new_token_ids", "spec_token_ids", "num_computed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_scheduled_tokens: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    spec_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., num_scheduled_tokens: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., spec_token_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_requests", "finished_request_ids", "tokens_from_last_stage", "trace_parent", "following", "decode_request_ids", "decode_token_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FROM_LAST_STAGE_FIELD_NUMBER: _ClassVar[int]
    TRACE_PARENT_FIELD_NUMBER: _ClassVar[int]
    FOLLOWING_FIELD_NUMBER: _ClassVar[int]
    DECODE_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    tokens_from_last_stage: bool
    trace_parent: str
    following: _containers.RepeatedCompositeFieldContainer[StepPlan]
    decode_request_ids: _containers.RepeatedScalarFieldContainer[str]
    decode_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., tokens_from_last_stage: _Optional[bool] = ..., trace_parent: _Optional[str] = ..., following: _Optional[_Iterable[_Union[StepPlan, _Mapping]]] = ..., decode_request_ids: _Optional[_Iterable[str]] = ..., decode_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("step_id", "stage", "request_ids", "token_ids", "logprobs", "logprobs_index", "compute_start_ns", "compute_end_ns", "wait_ns", "error", "plan_wait_ns")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_INDEX_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_START_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_END_NS_FIELD_NUMBER: _ClassVar[int]
    WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PLAN_WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    stage: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    logprobs_index: _containers.RepeatedScalarFieldContainer[int]
    compute_start_ns: int
    compute_end_ns: int
    wait_ns: int
    error: str
    plan_wait_ns: int
    def __init__(self, step_id: _Optional[int] = ..., stage: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., logprobs_index: _Optional[_Iterable[int]] = ..., compute_start_ns: _Optional[int] = ..., compute_end_ns: _Optional[int] = ..., wait_ns: _Optional[int] = ..., error: _Optional[str] = ..., plan_wait_ns: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("stage", "num_stages", "first_layer", "num_layers", "num_kv_blocks", "block_size", "ready", "model_name", "max_model_len", "vocab_size", "eos_token_ids", "device", "quantization", "tp_rank", "tensor_parallel_size", "weight_version")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    stage: int
    num_stages: int
    first_layer: int
    num_layers: int
    num_kv_blocks: int
    block_size: int
    ready: bool
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    device: str
    quantization: str
    tp_rank: int
    tensor_parallel_size: int
    weight_version: int
    def __init__(self, stage: _Optional[int] = ..., num_stages: _Optional[int] = ..., first_layer: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., ready: _Optional[bool] = ..., model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., device: _Optional[str] = ..., quantization: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., weight_version: _Optional[int] = ...) -> None: ...

class GetTimelineRequest(_message.Message):
    __slots__ = ("include_steps", "reset")
    INCLUDE_STEPS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    include_steps: bool
    reset: bool
    def __init__(self, include_steps: _Optional[bool] = ..., reset: _Optional[bool] = ...) -> None: ...

class StepTiming(_message.Message):
    __slots__ = ("step_id", "num_requests", "num_tokens", "start_ns", "end_ns", "wait_ns", "collective_ns", "plan_wait_ns")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_NS_FIELD_NUMBER: _ClassVar[int]
    PLAN_WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    num_requests: int
    num_tokens: int
    start_ns: int
    end_ns: int
    wait_ns: int
    collective_ns: int
    plan_wait_ns: int
    def __init__(self, step_id: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_tokens: _Optional[int] = ..., start_ns: _Optional[int] = ..., end_ns: _Optional[int] = ..., wait_ns: _Optional[int] = ..., collective_ns: _Optional[int] = ..., plan_wait_ns: _Optional[int] = ...) -> None: ...

class Timeline(_message.Message):
    __slots__ = ("stage", "busy_fraction", "bubble_fraction", "num_steps", "steps", "plan_wait_fraction")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PLAN_WAIT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    stage: int
    busy_fraction: float
    bubble_fraction: float
    num_steps: int
    steps: _containers.RepeatedCompositeFieldContainer[StepTiming]
    plan_wait_fraction: float
    def __init__(self, stage: _Optional[int] = ..., busy_fraction: _Optional[float] = ..., bubble_fraction: _Optional[float] = ..., num_steps: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[StepTiming, _Mapping]]] = ..., plan_wait_fraction: _Optional[float] = ...) -> None: ...
