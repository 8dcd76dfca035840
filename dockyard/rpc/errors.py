"""Domain errors that the server interceptor turns into gRPC status codes.

Servicers raise these with a message that says what is wrong; the caller
gets the matching status and the message, and the server keeps serving.
Litmus: InvalidArgument whatever the state, FailedPrecondition until the
state changes, NotFound for an unknown id, ResourceExhausted when full.
"""

from __future__ import annotations

import grpc


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


class Unimplemented(ServiceError, NotImplementedError):
    code = grpc.StatusCode.UNIMPLEMENTED
