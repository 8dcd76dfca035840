from dockyard.api.common.v1 import common_pb2 as _common_pb2
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
    __slots__ = ("request_id", "instance_id", "patch", "task_set", "limits")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PATCH_FIELD_NUMBER: _ClassVar[int]
    TASK_SET_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    instance_id: str
    patch: str
    task_set: str
    limits: Limits
    def __init__(self, request_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., patch: _Optional[str] = ..., task_set: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class TestResult(_message.Message):
    __slots__ = ("name", "passed", "status")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    name: str
    passed: bool
    status: str
    def __init__(self, name: _Optional[str] = ..., passed: _Optional[bool] = ..., status: _Optional[str] = ...) -> None: ...

class ScorePatchResponse(_message.Message):
    __slots__ = ("verdict", "resolved", "pass_rate", "fail_to_pass", "pass_to_pass")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    FAIL_TO_PASS_FIELD_NUMBER: _ClassVar[int]
    PASS_TO_PASS_FIELD_NUMBER: _ClassVar[int]
    verdict: _common_pb2.Verdict
    resolved: bool
    pass_rate: float
    fail_to_pass: _containers.RepeatedCompositeFieldContainer[TestResult]
    pass_to_pass: _containers.RepeatedCompositeFieldContainer[TestResult]
    def __init__(self, verdict: _Optional[_Union[_common_pb2.Verdict, _Mapping]] = ..., resolved: _Optional[bool] = ..., pass_rate: _Optional[float] = ..., fail_to_pass: _Optional[_Iterable[_Union[TestResult, _Mapping]]] = ..., pass_to_pass: _Optional[_Iterable[_Union[TestResult, _Mapping]]] = ...) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ("task_set",)
    TASK_SET_FIELD_NUMBER: _ClassVar[int]
    task_set: str
    def __init__(self, task_set: _Optional[str] = ...) -> None: ...

class InstanceSummary(_message.Message):
    __slots__ = ("task_set", "instance_id", "repo", "base_commit", "num_fail_to_pass", "num_pass_to_pass", "test_command", "log_parser", "requirements")
    TASK_SET_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REPO_FIELD_NUMBER: _ClassVar[int]
    BASE_COMMIT_FIELD_NUMBER: _ClassVar[int]
    NUM_FAIL_TO_PASS_FIELD_NUMBER: _ClassVar[int]
    NUM_PASS_TO_PASS_FIELD_NUMBER: _ClassVar[int]
    TEST_COMMAND_FIELD_NUMBER: _ClassVar[int]
    LOG_PARSER_FIELD_NUMBER: _ClassVar[int]
    REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    task_set: str
    instance_id: str
    repo: str
    base_commit: str
    num_fail_to_pass: int
    num_pass_to_pass: int
    test_command: _containers.RepeatedScalarFieldContainer[str]
    log_parser: str
    requirements: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_set: _Optional[str] = ..., instance_id: _Optional[str] = ..., repo: _Optional[str] = ..., base_commit: _Optional[str] = ..., num_fail_to_pass: _Optional[int] = ..., num_pass_to_pass: _Optional[int] = ..., test_command: _Optional[_Iterable[str]] = ..., log_parser: _Optional[str] = ..., requirements: _Optional[_Iterable[str]] = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceSummary]
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceSummary, _Mapping]]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("request_id", "files", "task_set", "instance_id", "limits", "idle_timeout_seconds", "endpoint_address", "packages")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    TASK_SET_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PACKAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    files: _containers.ScalarMap[str, str]
    task_set: str
    instance_id: str
    limits: Limits
    idle_timeout_seconds: float
    endpoint_address: str
    packages: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., files: _Optional[_Mapping[str, str]] = ..., task_set: _Optional[str] = ..., instance_id: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., idle_timeout_seconds: _Optional[float] = ..., endpoint_address: _Optional[str] = ..., packages: _Optional[_Iterable[str]] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "work_dir", "idle_timeout_seconds", "endpoint_url")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WORK_DIR_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_URL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    work_dir: str
    idle_timeout_seconds: float
    endpoint_url: str
    def __init__(self, session_id: _Optional[str] = ..., work_dir: _Optional[str] = ..., idle_timeout_seconds: _Optional[float] = ..., endpoint_url: _Optional[str] = ...) -> None: ...

class SessionExecRequest(_message.Message):
    __slots__ = ("session_id", "command", "shell", "stdin", "timeout_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    SHELL_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    command: _containers.RepeatedScalarFieldContainer[str]
    shell: str
    stdin: bytes
    timeout_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., shell: _Optional[str] = ..., stdin: _Optional[bytes] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class SessionExecResponse(_message.Message):
    __slots__ = ("verdict", "timed_out")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    verdict: _common_pb2.Verdict
    timed_out: bool
    def __init__(self, verdict: _Optional[_Union[_common_pb2.Verdict, _Mapping]] = ..., timed_out: _Optional[bool] = ...) -> None: ...

class ReadFileRequest(_message.Message):
    __slots__ = ("session_id", "path", "max_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    path: str
    max_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., path: _Optional[str] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class ReadFileResponse(_message.Message):
    __slots__ = ("content", "size", "truncated")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    content: bytes
    size: int
    truncated: bool
    def __init__(self, content: _Optional[bytes] = ..., size: _Optional[int] = ..., truncated: _Optional[bool] = ...) -> None: ...

class WriteFileRequest(_message.Message):
    __slots__ = ("session_id", "path", "content")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    path: str
    content: bytes
    def __init__(self, session_id: _Optional[str] = ..., path: _Optional[str] = ..., content: _Optional[bytes] = ...) -> None: ...

class WriteFileResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ScoreSessionRequest(_message.Message):
    __slots__ = ("session_id", "limits")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    limits: Limits
    def __init__(self, session_id: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class ScoreSessionResponse(_message.Message):
    __slots__ = ("score", "patch")
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PATCH_FIELD_NUMBER: _ClassVar[int]
    score: ScorePatchResponse
    patch: str
    def __init__(self, score: _Optional[_Union[ScorePatchResponse, _Mapping]] = ..., patch: _Optional[str] = ...) -> None: ...

class RewardRequest(_message.Message):
    __slots__ = ("request_id", "source", "function", "origin", "input_json", "limits")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    INPUT_JSON_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    source: str
    function: str
    origin: str
    input_json: str
    limits: Limits
    def __init__(self, request_id: _Optional[str] = ..., source: _Optional[str] = ..., function: _Optional[str] = ..., origin: _Optional[str] = ..., input_json: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class RewardResponse(_message.Message):
    __slots__ = ("verdict", "reward")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    verdict: _common_pb2.Verdict
    reward: float
    def __init__(self, verdict: _Optional[_Union[_common_pb2.Verdict, _Mapping]] = ..., reward: _Optional[float] = ...) -> None: ...

class PrepareSessionsRequest(_message.Message):
    __slots__ = ("job_id", "size", "limits", "packages", "routed", "images", "task_set", "instance_ids")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    PACKAGES_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    TASK_SET_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    size: int
    limits: Limits
    packages: _containers.RepeatedScalarFieldContainer[str]
    routed: bool
    images: _containers.RepeatedScalarFieldContainer[str]
    task_set: str
    instance_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., size: _Optional[int] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., packages: _Optional[_Iterable[str]] = ..., routed: _Optional[bool] = ..., images: _Optional[_Iterable[str]] = ..., task_set: _Optional[str] = ..., instance_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PrepareSessionsResponse(_message.Message):
    __slots__ = ("warm", "instance_images")
    WARM_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_IMAGES_FIELD_NUMBER: _ClassVar[int]
    warm: int
    instance_images: int
    def __init__(self, warm: _Optional[int] = ..., instance_images: _Optional[int] = ...) -> None: ...

class ReleaseSessionsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ReleaseSessionsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
