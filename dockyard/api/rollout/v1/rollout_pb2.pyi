from dockyard.api.buffer.v1 import buffer_pb2 as _buffer_pb2
from dockyard.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadPolicyRequest(_message.Message):
    __slots__ = ("job_id", "config_yaml")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    config_yaml: str
    def __init__(self, job_id: _Optional[str] = ..., config_yaml: _Optional[str] = ...) -> None: ...

class LoadPolicyResponse(_message.Message):
    __slots__ = ("engine", "weight_version")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    engine: str
    weight_version: int
    def __init__(self, engine: _Optional[str] = ..., weight_version: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("job_id", "request_id", "prompt", "num_samples", "sampling", "prompt_token_ids", "messages", "images", "top_logprobs", "staging", "return_routing")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTING_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    request_id: str
    prompt: str
    num_samples: int
    sampling: _common_pb2.SamplingParams
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    images: _containers.RepeatedScalarFieldContainer[bytes]
    top_logprobs: int
    staging: PayloadStaging
    return_routing: bool
    def __init__(self, job_id: _Optional[str] = ..., request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., num_samples: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., images: _Optional[_Iterable[bytes]] = ..., top_logprobs: _Optional[int] = ..., staging: _Optional[_Union[PayloadStaging, _Mapping]] = ..., return_routing: _Optional[bool] = ...) -> None: ...

class PayloadStaging(_message.Message):
    __slots__ = ("data_plane", "group_id")
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    data_plane: _buffer_pb2.GetDataPlaneResponse
    group_id: str
    def __init__(self, data_plane: _Optional[_Union[_buffer_pb2.GetDataPlaneResponse, _Mapping]] = ..., group_id: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("token_ids", "logprobs", "text", "finish_reason", "top_logprobs", "num_tokens", "routing", "prompt_routing")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ROUTING_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    finish_reason: str
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    num_tokens: int
    routing: bytes
    prompt_routing: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., routing: _Optional[bytes] = ..., prompt_routing: _Optional[bytes] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("prompt_token_ids", "completions", "weight_version", "weight_versions", "kv_cache", "payload_key", "payload_bytes", "prompt_routing", "routing_shape")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_KEY_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ROUTING_FIELD_NUMBER: _ClassVar[int]
    ROUTING_SHAPE_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    weight_version: int
    weight_versions: _containers.RepeatedScalarFieldContainer[int]
    kv_cache: KvCacheStats
    payload_key: str
    payload_bytes: int
    prompt_routing: bytes
    routing_shape: _common_pb2.RoutingShape
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., weight_version: _Optional[int] = ..., weight_versions: _Optional[_Iterable[int]] = ..., kv_cache: _Optional[_Union[KvCacheStats, _Mapping]] = ..., payload_key: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., prompt_routing: _Optional[bytes] = ..., routing_shape: _Optional[_Union[_common_pb2.RoutingShape, _Mapping]] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("deltas", "result")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[CompletionDelta]
    result: GenerateResponse
    def __init__(self, deltas: _Optional[_Iterable[_Union[CompletionDelta, _Mapping]]] = ..., result: _Optional[_Union[GenerateResponse, _Mapping]] = ...) -> None: ...

class GenerateMultiplexedRequest(_message.Message):
    __slots__ = ("call_id", "start", "cancel", "timeout_seconds")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    start: GenerateStreamRequest
    cancel: GenerateMultiplexedCancel
    timeout_seconds: float
    def __init__(self, call_id: _Optional[int] = ..., start: _Optional[_Union[GenerateStreamRequest, _Mapping]] = ..., cancel: _Optional[_Union[GenerateMultiplexedCancel, _Mapping]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class GenerateMultiplexedCancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateMultiplexedResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[CallEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[CallEvent, _Mapping]]] = ...) -> None: ...

class CallEvent(_message.Message):
    __slots__ = ("call_id", "message", "status")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    message: GenerateStreamResponse
    status: CallStatus
    def __init__(self, call_id: _Optional[int] = ..., message: _Optional[_Union[GenerateStreamResponse, _Mapping]] = ..., status: _Optional[_Union[CallStatus, _Mapping]] = ...) -> None: ...

class CallStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class CompletionDelta(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class KvCacheStats(_message.Message):
    __slots__ = ("capacity_tokens", "live_tokens", "cached_tokens", "cached_entries", "prefill_tokens_computed", "prefill_tokens_saved", "evictions", "pressure")
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_SAVED_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_FIELD_NUMBER: _ClassVar[int]
    capacity_tokens: int
    live_tokens: int
    cached_tokens: int
    cached_entries: int
    prefill_tokens_computed: int
    prefill_tokens_saved: int
    evictions: int
    pressure: float
    def __init__(self, capacity_tokens: _Optional[int] = ..., live_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cached_entries: _Optional[int] = ..., prefill_tokens_computed: _Optional[int] = ..., prefill_tokens_saved: _Optional[int] = ..., evictions: _Optional[int] = ..., pressure: _Optional[float] = ...) -> None: ...

class ReceiveWeightsRequest(_message.Message):
    __slots__ = ("job_id", "weight_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    weight_version: int
    def __init__(self, job_id: _Optional[str] = ..., weight_version: _Optional[int] = ...) -> None: ...

class ReceiveWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "checksum", "num_bytes", "seconds")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    checksum: str
    num_bytes: int
    seconds: float
    def __init__(self, weight_version: _Optional[int] = ..., checksum: _Optional[str] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GetEngineInfoRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetEngineInfoResponse(_message.Message):
    __slots__ = ("engine", "model", "weight_version", "num_parameters")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    engine: str
    model: str
    weight_version: int
    num_parameters: int
    def __init__(self, engine: _Optional[str] = ..., model: _Optional[str] = ..., weight_version: _Optional[int] = ..., num_parameters: _Optional[int] = ...) -> None: ...

class UnloadPolicyRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class UnloadPolicyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
