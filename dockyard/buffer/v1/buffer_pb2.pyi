from dockyard.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutGroupRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: _common_pb2.Group
    def __init__(self, group: _Optional[_Union[_common_pb2.Group, _Mapping]] = ...) -> None: ...

class PutGroupResponse(_message.Message):
    __slots__ = ("duplicate",)
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    def __init__(self, duplicate: _Optional[bool] = ...) -> None: ...

class SampleGroupsRequest(_message.Message):
    __slots__ = ("job_id", "trainer_step", "max_groups", "max_trajectory_age_steps")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MAX_TRAJECTORY_AGE_STEPS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    trainer_step: int
    max_groups: int
    max_trajectory_age_steps: int
    def __init__(self, job_id: _Optional[str] = ..., trainer_step: _Optional[int] = ..., max_groups: _Optional[int] = ..., max_trajectory_age_steps: _Optional[int] = ...) -> None: ...

class SampleGroupsResponse(_message.Message):
    __slots__ = ("groups", "dropped_stale")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_common_pb2.Group]
    dropped_stale: int
    def __init__(self, groups: _Optional[_Iterable[_Union[_common_pb2.Group, _Mapping]]] = ..., dropped_stale: _Optional[int] = ...) -> None: ...

class AckGroupsRequest(_message.Message):
    __slots__ = ("job_id", "group_ids")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., group_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AckGroupsResponse(_message.Message):
    __slots__ = ("acked",)
    ACKED_FIELD_NUMBER: _ClassVar[int]
    acked: int
    def __init__(self, acked: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("held", "pending", "acked", "dropped_stale", "puts", "duplicate_puts")
    HELD_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_PUTS_FIELD_NUMBER: _ClassVar[int]
    held: int
    pending: int
    acked: int
    dropped_stale: int
    puts: int
    duplicate_puts: int
    def __init__(self, held: _Optional[int] = ..., pending: _Optional[int] = ..., acked: _Optional[int] = ..., dropped_stale: _Optional[int] = ..., puts: _Optional[int] = ..., duplicate_puts: _Optional[int] = ...) -> None: ...
