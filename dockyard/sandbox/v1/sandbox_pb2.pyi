from dockyard.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Limits(_message.Message):
    __slots__ = ("timeout_seconds", "memory_mb", "cpu_seconds", "max_output_bytes")
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    memory_mb: int
    cpu_seconds: float
    max_output_bytes: int
    def __init__(self, timeout_seconds: _Optional[float] = ..., memory_mb: _Optional[int] = ..., cpu_seconds: _Optional[float] = ..., max_output_bytes: _Optional[int] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("request_id", "files", "command", "limits")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    files: _containers.ScalarMap[str, str]
    command: _containers.RepeatedScalarFieldContainer[str]
    limits: Limits
    def __init__(self, request_id: _Optional[str] = ..., files: _Optional[_Mapping[str, str]] = ..., command: _Optional[_Iterable[str]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("verdict",)
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    verdict: _common_pb2.Verdict
    def __init__(self, verdict: _Optional[_Union[_common_pb2.Verdict, _Mapping]] = ...) -> None: ...

class RunTestsRequest(_message.Message):
    __slots__ = ("request_id", "program", "tests", "limits")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    TESTS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    program: str
    tests: _containers.RepeatedScalarFieldContainer[str]
    limits: Limits
    def __init__(self, request_id: _Optional[str] = ..., program: _Optional[str] = ..., tests: _Optional[_Iterable[str]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class RunTestsResponse(_message.Message):
    __slots__ = ("verdict",)
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    verdict: _common_pb2.Verdict
    def __init__(self, verdict: _Optional[_Union[_common_pb2.Verdict, _Mapping]] = ...) -> None: ...

class ScorePatchRequest(_message.Message):
    __slots__ = ("request_id", "instance_id", "patch")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PATCH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    instance_id: str
    patch: str
    def __init__(self, request_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., patch: _Optional[str] = ...) -> None: ...

class ScorePatchResponse(_message.Message):
    __slots__ = ("verdict",)
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    verdict: _common_pb2.Verdict
    def __init__(self, verdict: _Optional[_Union[_common_pb2.Verdict, _Mapping]] = ...) -> None: ...
