import datetime

from dockyard.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_KIND_UNSPECIFIED: _ClassVar[MemberKind]
    MEMBER_KIND_ROLLOUT: _ClassVar[MemberKind]
    MEMBER_KIND_SANDBOX: _ClassVar[MemberKind]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
MEMBER_KIND_UNSPECIFIED: MemberKind
MEMBER_KIND_ROLLOUT: MemberKind
MEMBER_KIND_SANDBOX: MemberKind
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState

class Member(_message.Message):
    __slots__ = ("kind", "name", "address", "status", "load", "in_flight", "seconds_since_heartbeat", "weight_versions", "kv_pressure")
    class WeightVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    kind: MemberKind
    name: str
    address: str
    status: str
    load: int
    in_flight: int
    seconds_since_heartbeat: float
    weight_versions: _containers.ScalarMap[str, int]
    kv_pressure: float
    def __init__(self, kind: _Optional[_Union[MemberKind, str]] = ..., name: _Optional[str] = ..., address: _Optional[str] = ..., status: _Optional[str] = ..., load: _Optional[int] = ..., in_flight: _Optional[int] = ..., seconds_since_heartbeat: _Optional[float] = ..., weight_versions: _Optional[_Mapping[str, int]] = ..., kv_pressure: _Optional[float] = ...) -> None: ...

class RegisterMemberRequest(_message.Message):
    __slots__ = ("kind", "name", "address")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    kind: MemberKind
    name: str
    address: str
    def __init__(self, kind: _Optional[_Union[MemberKind, str]] = ..., name: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class RegisterMemberResponse(_message.Message):
    __slots__ = ("heartbeat_seconds",)
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_seconds: float
    def __init__(self, heartbeat_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("name", "load", "running", "queued", "kv_pressure")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    KV_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    name: str
    load: int
    running: int
    queued: int
    kv_pressure: float
    def __init__(self, name: _Optional[str] = ..., load: _Optional[int] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., kv_pressure: _Optional[float] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnregisterMemberRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterMemberResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMembersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMembersResponse(_message.Message):
    __slots__ = ("members",)
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[Member]
    def __init__(self, members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ...) -> None: ...

class ServiceStatus(_message.Message):
    __slots__ = ("name", "address", "status")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    status: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., status: _Optional[str] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "state", "step", "max_steps", "weight_version", "phase", "metrics", "validation_metrics", "services", "message", "run_dir", "create_time", "update_time", "warnings")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ValidationMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_METRICS_FIELD_NUMBER: _ClassVar[int]
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    step: int
    max_steps: int
    weight_version: int
    phase: str
    metrics: _containers.ScalarMap[str, float]
    validation_metrics: _containers.ScalarMap[str, float]
    services: _containers.RepeatedCompositeFieldContainer[ServiceStatus]
    message: str
    run_dir: str
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., step: _Optional[int] = ..., max_steps: _Optional[int] = ..., weight_version: _Optional[int] = ..., phase: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., validation_metrics: _Optional[_Mapping[str, float]] = ..., services: _Optional[_Iterable[_Union[ServiceStatus, _Mapping]]] = ..., message: _Optional[str] = ..., run_dir: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("config_yaml", "job_id")
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    config_yaml: str
    job_id: str
    def __init__(self, config_yaml: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class CreateJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class GetWeightSyncGroupRequest(_message.Message):
    __slots__ = ("job_id", "member", "failed_epoch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    FAILED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    member: str
    failed_epoch: int
    def __init__(self, job_id: _Optional[str] = ..., member: _Optional[str] = ..., failed_epoch: _Optional[int] = ...) -> None: ...

class GetWeightSyncGroupResponse(_message.Message):
    __slots__ = ("group", "rank")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    group: _common_pb2.WeightSyncGroup
    rank: int
    def __init__(self, group: _Optional[_Union[_common_pb2.WeightSyncGroup, _Mapping]] = ..., rank: _Optional[int] = ...) -> None: ...

class LeaveWeightSyncGroupRequest(_message.Message):
    __slots__ = ("job_id", "member")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    member: str
    def __init__(self, job_id: _Optional[str] = ..., member: _Optional[str] = ...) -> None: ...

class LeaveWeightSyncGroupResponse(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: _common_pb2.WeightSyncGroup
    def __init__(self, group: _Optional[_Union[_common_pb2.WeightSyncGroup, _Mapping]] = ...) -> None: ...
