from services.common.proto.conveyor.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftSequence(_message.Message):
    __slots__ = ("request_id", "start", "token_ids", "num_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., start: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("sequences", "finished_request_ids")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[DraftSequence]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sequences: _Optional[_Iterable[_Union[DraftSequence, _Mapping]]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("request_id", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("proposals", "unknown_request_ids")
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[DraftProposal]
    unknown_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, proposals: _Optional[_Iterable[_Union[DraftProposal, _Mapping]]] = ..., unknown_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...
