from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerdictStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERDICT_STATUS_UNSPECIFIED: _ClassVar[VerdictStatus]
    VERDICT_STATUS_PASSED: _ClassVar[VerdictStatus]
    VERDICT_STATUS_FAILED: _ClassVar[VerdictStatus]
    VERDICT_STATUS_ERROR: _ClassVar[VerdictStatus]
    VERDICT_STATUS_TIMEOUT: _ClassVar[VerdictStatus]
    VERDICT_STATUS_PATCH_FAILED: _ClassVar[VerdictStatus]
VERDICT_STATUS_UNSPECIFIED: VerdictStatus
VERDICT_STATUS_PASSED: VerdictStatus
VERDICT_STATUS_FAILED: VerdictStatus
VERDICT_STATUS_ERROR: VerdictStatus
VERDICT_STATUS_TIMEOUT: VerdictStatus
VERDICT_STATUS_PATCH_FAILED: VerdictStatus

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop", "ignore_eos", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., seed: _Optional[int] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("status", "tests_passed", "tests_total", "exit_code", "stdout", "stderr", "output_truncated", "duration_seconds", "error_message", "integrity_violation", "protected_paths_touched")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TESTS_PASSED_FIELD_NUMBER: _ClassVar[int]
    TESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_VIOLATION_FIELD_NUMBER: _ClassVar[int]
    PROTECTED_PATHS_TOUCHED_FIELD_NUMBER: _ClassVar[int]
    status: VerdictStatus
    tests_passed: int
    tests_total: int
    exit_code: int
    stdout: str
    stderr: str
    output_truncated: bool
    duration_seconds: float
    error_message: str
    integrity_violation: bool
    protected_paths_touched: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status: _Optional[_Union[VerdictStatus, str]] = ..., tests_passed: _Optional[int] = ..., tests_total: _Optional[int] = ..., exit_code: _Optional[int] = ..., stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., output_truncated: _Optional[bool] = ..., duration_seconds: _Optional[float] = ..., error_message: _Optional[str] = ..., integrity_violation: _Optional[bool] = ..., protected_paths_touched: _Optional[_Iterable[str]] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "prompt_token_ids", "completion_token_ids", "completion_logprobs", "completion_text", "weight_version", "reward", "valid", "verdict", "finish_reason", "completion_loss_mask", "later_segments", "num_turns", "invalid_actions", "sampled_tokens", "routing", "routing_shape")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TEXT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    LATER_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    INVALID_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    ROUTING_SHAPE_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_logprobs: _containers.RepeatedScalarFieldContainer[float]
    completion_text: str
    weight_version: int
    reward: float
    valid: bool
    verdict: Verdict
    finish_reason: str
    completion_loss_mask: _containers.RepeatedScalarFieldContainer[int]
    later_segments: _containers.RepeatedCompositeFieldContainer[Segment]
    num_turns: int
    invalid_actions: int
    sampled_tokens: int
    routing: bytes
    routing_shape: RoutingShape
    def __init__(self, trajectory_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., completion_logprobs: _Optional[_Iterable[float]] = ..., completion_text: _Optional[str] = ..., weight_version: _Optional[int] = ..., reward: _Optional[float] = ..., valid: _Optional[bool] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., finish_reason: _Optional[str] = ..., completion_loss_mask: _Optional[_Iterable[int]] = ..., later_segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., num_turns: _Optional[int] = ..., invalid_actions: _Optional[int] = ..., sampled_tokens: _Optional[int] = ..., routing: _Optional[bytes] = ..., routing_shape: _Optional[_Union[RoutingShape, _Mapping]] = ...) -> None: ...

class RoutingShape(_message.Message):
    __slots__ = ("moe_layers", "top_k", "num_experts")
    MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    moe_layers: int
    top_k: int
    num_experts: int
    def __init__(self, moe_layers: _Optional[int] = ..., top_k: _Optional[int] = ..., num_experts: _Optional[int] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("prompt_token_ids", "completion_token_ids", "completion_logprobs", "completion_loss_mask", "routing")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_logprobs: _containers.RepeatedScalarFieldContainer[float]
    completion_loss_mask: _containers.RepeatedScalarFieldContainer[int]
    routing: bytes
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., completion_logprobs: _Optional[_Iterable[float]] = ..., completion_loss_mask: _Optional[_Iterable[int]] = ..., routing: _Optional[bytes] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("group_id", "job_id", "task_id", "prompt", "weight_version", "trajectories")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    job_id: str
    task_id: str
    prompt: str
    weight_version: int
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    def __init__(self, group_id: _Optional[str] = ..., job_id: _Optional[str] = ..., task_id: _Optional[str] = ..., prompt: _Optional[str] = ..., weight_version: _Optional[int] = ..., trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ...) -> None: ...

class WeightSyncGroup(_message.Message):
    __slots__ = ("master_address", "master_port", "world_size", "epoch", "backend", "secret")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    world_size: int
    epoch: int
    backend: str
    secret: str
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., epoch: _Optional[int] = ..., backend: _Optional[str] = ..., secret: _Optional[str] = ...) -> None: ...
