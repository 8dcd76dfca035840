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
    __slots__ = ("weight_version", "num_parameters", "resumed_from", "data_state")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_FIELD_NUMBER: _ClassVar[int]
    DATA_STATE_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    num_parameters: int
    resumed_from: str
    data_state: str
    def __init__(self, weight_version: _Optional[int] = ..., num_parameters: _Optional[int] = ..., resumed_from: _Optional[str] = ..., data_state: _Optional[str] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("job_id", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("weight_version", "groups_trained", "trajectories_trained", "groups_dropped_stale", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUPS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_TRAINED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    groups_trained: int
    trajectories_trained: int
    groups_dropped_stale: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, weight_version: _Optional[int] = ..., groups_trained: _Optional[int] = ..., trajectories_trained: _Optional[int] = ..., groups_dropped_stale: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Demonstration(_message.Message):
    __slots__ = ("prompt", "completion")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    completion: str
    def __init__(self, prompt: _Optional[str] = ..., completion: _Optional[str] = ...) -> None: ...

class SupervisedStepRequest(_message.Message):
    __slots__ = ("job_id", "step", "demonstrations")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DEMONSTRATIONS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    demonstrations: _containers.RepeatedCompositeFieldContainer[Demonstration]
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., demonstrations: _Optional[_Iterable[_Union[Demonstration, _Mapping]]] = ...) -> None: ...

class SupervisedStepResponse(_message.Message):
    __slots__ = ("weight_version", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, weight_version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
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

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("job_id", "metrics", "data_state")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    DATA_STATE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    metrics: _containers.ScalarMap[str, float]
    data_state: str
    def __init__(self, job_id: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., data_state: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "step", "removed")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    removed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., removed: _Optional[_Iterable[str]] = ...) -> None: ...

class UnloadPolicyRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class UnloadPolicyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
