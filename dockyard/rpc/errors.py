"""Domain errors that the server interceptor turns into gRPC status codes.

Servicers raise these with a message that says what is wrong; the caller
gets the matching status and the message, and the server keeps serving.
Litmus: InvalidArgument whatever the state, FailedPrecondition until the
state changes, NotFound for an unknown id, ResourceExhausted when full.

Guarantees: a message goes out through `clip`, so one that echoes a huge value
(a 1 MB id) keeps its head and tail and stays far below gRPC's metadata limit.
"""

from __future__ import annotations

import grpc

# gRPC carries the message in trailing metadata (8 KiB by default, all headers together).
MAX_MESSAGE_CHARS = 2048


def clip(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message` cut in the middle to at most about `limit` characters, saying how much was left out."""
    if len(message) <= limit:
        return message
    head, tail = message[: limit * 2 // 3], message[-(limit // 4) :]
    return f"{head}...[{len(message) - len(head) - len(tail)} characters left out]...{tail}"


class ServiceError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(ServiceError, KeyError):
    code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    """A dependency is down; nothing changed, so the caller may retry."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    """The caller's deadline passed (or it cancelled), before the work started or during it (which stopped it)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unimplemented(ServiceError, NotImplementedError):
    code = grpc.StatusCode.UNIMPLEMENTED
