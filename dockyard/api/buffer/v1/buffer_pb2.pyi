from dockyard.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenJobRequest(_message.Message):
    __slots__ = ("job_id", "max_groups", "max_trajectory_age_steps", "rewind_to_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MAX_TRAJECTORY_AGE_STEPS_FIELD_NUMBER: _ClassVar[int]
    REWIND_TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    max_groups: int
    max_trajectory_age_steps: int
    rewind_to_version: int
    def __init__(self, job_id: _Optional[str] = ..., max_groups: _Optional[int] = ..., max_trajectory_age_steps: _Optional[int] = ..., rewind_to_version: _Optional[int] = ...) -> None: ...

class OpenJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CloseJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PutGroupRequest(_message.Message):
    __slots__ = ("group", "payload_key", "payload_bytes")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_KEY_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    group: _common_pb2.Group
    payload_key: str
    payload_bytes: int
    def __init__(self, group: _Optional[_Union[_common_pb2.Group, _Mapping]] = ..., payload_key: _Optional[str] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class PutGroupStreamRequest(_message.Message):
    __slots__ = ("group", "payload")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    group: _common_pb2.Group
    payload: bytes
    def __init__(self, group: _Optional[_Union[_common_pb2.Group, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PutGroupResponse(_message.Message):
    __slots__ = ("duplicate", "dropped_stale")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    dropped_stale: bool
    def __init__(self, duplicate: _Optional[bool] = ..., dropped_stale: _Optional[bool] = ...) -> None: ...

class PutGroupStreamResponse(_message.Message):
    __slots__ = ("duplicate", "dropped_stale")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    dropped_stale: bool
    def __init__(self, duplicate: _Optional[bool] = ..., dropped_stale: _Optional[bool] = ...) -> None: ...

class SampleGroupsRequest(_message.Message):
    __slots__ = ("job_id", "trainer_step", "max_groups", "consumer", "lease_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    trainer_step: int
    max_groups: int
    consumer: str
    lease_id: str
    def __init__(self, job_id: _Optional[str] = ..., trainer_step: _Optional[int] = ..., max_groups: _Optional[int] = ..., consumer: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class SampleGroupsResponse(_message.Message):
    __slots__ = ("groups", "dropped_stale")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_common_pb2.Group]
    dropped_stale: int
    def __init__(self, groups: _Optional[_Iterable[_Union[_common_pb2.Group, _Mapping]]] = ..., dropped_stale: _Optional[int] = ...) -> None: ...

class SampleGroupsStreamRequest(_message.Message):
    __slots__ = ("job_id", "trainer_step", "max_groups", "consumer", "payload_by_reference", "lease_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BY_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    trainer_step: int
    max_groups: int
    consumer: str
    payload_by_reference: bool
    lease_id: str
    def __init__(self, job_id: _Optional[str] = ..., trainer_step: _Optional[int] = ..., max_groups: _Optional[int] = ..., consumer: _Optional[str] = ..., payload_by_reference: _Optional[bool] = ..., lease_id: _Optional[str] = ...) -> None: ...

class SampleGroupsStreamResponse(_message.Message):
    __slots__ = ("group", "payload", "dropped_stale", "done", "payload_key")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_KEY_FIELD_NUMBER: _ClassVar[int]
    group: bytes
    payload: bytes
    dropped_stale: int
    done: bool
    payload_key: str
    def __init__(self, group: _Optional[bytes] = ..., payload: _Optional[bytes] = ..., dropped_stale: _Optional[int] = ..., done: _Optional[bool] = ..., payload_key: _Optional[str] = ...) -> None: ...

class ReclaimGroupsRequest(_message.Message):
    __slots__ = ("job_id", "trainer_step", "max_groups", "consumer", "min_idle_seconds", "lease_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    MIN_IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    trainer_step: int
    max_groups: int
    consumer: str
    min_idle_seconds: float
    lease_id: str
    def __init__(self, job_id: _Optional[str] = ..., trainer_step: _Optional[int] = ..., max_groups: _Optional[int] = ..., consumer: _Optional[str] = ..., min_idle_seconds: _Optional[float] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReclaimGroupsResponse(_message.Message):
    __slots__ = ("groups", "dropped_stale")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_common_pb2.Group]
    dropped_stale: int
    def __init__(self, groups: _Optional[_Iterable[_Union[_common_pb2.Group, _Mapping]]] = ..., dropped_stale: _Optional[int] = ...) -> None: ...

class AckGroupsRequest(_message.Message):
    __slots__ = ("job_id", "group_ids", "weight_version", "lease_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    weight_version: int
    lease_id: str
    def __init__(self, job_id: _Optional[str] = ..., group_ids: _Optional[_Iterable[str]] = ..., weight_version: _Optional[int] = ..., lease_id: _Optional[str] = ...) -> None: ...

class TakeTrainerLeaseRequest(_message.Message):
    __slots__ = ("job_id", "consumer")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    consumer: str
    def __init__(self, job_id: _Optional[str] = ..., consumer: _Optional[str] = ...) -> None: ...

class TakeTrainerLeaseResponse(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class AckGroupsResponse(_message.Message):
    __slots__ = ("acked",)
    ACKED_FIELD_NUMBER: _ClassVar[int]
    acked: int
    def __init__(self, acked: _Optional[int] = ...) -> None: ...

class ReclaimGroupsStreamRequest(_message.Message):
    __slots__ = ("job_id", "trainer_step", "max_groups", "consumer", "min_idle_seconds", "payload_by_reference", "lease_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    MIN_IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BY_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    trainer_step: int
    max_groups: int
    consumer: str
    min_idle_seconds: float
    payload_by_reference: bool
    lease_id: str
    def __init__(self, job_id: _Optional[str] = ..., trainer_step: _Optional[int] = ..., max_groups: _Optional[int] = ..., consumer: _Optional[str] = ..., min_idle_seconds: _Optional[float] = ..., payload_by_reference: _Optional[bool] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReclaimGroupsStreamResponse(_message.Message):
    __slots__ = ("group", "payload", "dropped_stale", "done", "payload_key")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_KEY_FIELD_NUMBER: _ClassVar[int]
    group: bytes
    payload: bytes
    dropped_stale: int
    done: bool
    payload_key: str
    def __init__(self, group: _Optional[bytes] = ..., payload: _Optional[bytes] = ..., dropped_stale: _Optional[int] = ..., done: _Optional[bool] = ..., payload_key: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("held", "pending", "acked", "dropped_stale", "puts", "duplicate_puts", "reclaimed", "latest_version", "max_groups", "max_trajectory_age_steps", "put_rate", "sample_rate", "age_histogram")
    class AgeHistogramEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    HELD_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_PUTS_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MAX_TRAJECTORY_AGE_STEPS_FIELD_NUMBER: _ClassVar[int]
    PUT_RATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    AGE_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    held: int
    pending: int
    acked: int
    dropped_stale: int
    puts: int
    duplicate_puts: int
    reclaimed: int
    latest_version: int
    max_groups: int
    max_trajectory_age_steps: int
    put_rate: float
    sample_rate: float
    age_histogram: _containers.ScalarMap[int, int]
    def __init__(self, held: _Optional[int] = ..., pending: _Optional[int] = ..., acked: _Optional[int] = ..., dropped_stale: _Optional[int] = ..., puts: _Optional[int] = ..., duplicate_puts: _Optional[int] = ..., reclaimed: _Optional[int] = ..., latest_version: _Optional[int] = ..., max_groups: _Optional[int] = ..., max_trajectory_age_steps: _Optional[int] = ..., put_rate: _Optional[float] = ..., sample_rate: _Optional[float] = ..., age_histogram: _Optional[_Mapping[int, int]] = ...) -> None: ...

class GetDataPlaneRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDataPlaneResponse(_message.Message):
    __slots__ = ("redis_url", "key_prefix", "staging_ttl_seconds", "max_trajectory_tokens", "max_group_bytes")
    REDIS_URL_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    STAGING_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TRAJECTORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUP_BYTES_FIELD_NUMBER: _ClassVar[int]
    redis_url: str
    key_prefix: str
    staging_ttl_seconds: int
    max_trajectory_tokens: int
    max_group_bytes: int
    def __init__(self, redis_url: _Optional[str] = ..., key_prefix: _Optional[str] = ..., staging_ttl_seconds: _Optional[int] = ..., max_trajectory_tokens: _Optional[int] = ..., max_group_bytes: _Optional[int] = ...) -> None: ...
