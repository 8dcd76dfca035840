"""The endpoint's error replies and its request-size limit.

Guarantees: every error the endpoint sends is JSON
`{"type": "error", "error": {"type", "message", "param", "code"}}`: Anthropic's shape, with OpenAI's
`param` (the request field at fault, or null) and `code` (a stable machine-readable name, or null),
so both official clients read it whole; a body over the limit is a 413 before any of it is parsed
(by its Content-Length, or while it streams in without one).
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException


class BadRequest(ValueError):
    """The request is well formed JSON but asks for something the endpoint refuses (a 400)."""


def error_response(
    status: int, kind: str, message: str, *, param: str | None = None, code: str | None = None
) -> JSONResponse:
    error = {"type": kind, "message": message, "param": param, "code": code}
    return JSONResponse({"type": "error", "error": error}, status_code=status)


def invalid_body(exc: RequestValidationError) -> JSONResponse:
    """Malformed JSON is a 400; a body that does not fit the schema a 422 naming the first field."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return error_response(
            400, "invalid_request_error", f"the body is not valid JSON: {errors[0].get('msg')}", code="invalid_json"
        )
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = f"{where or 'body'}: {first.get('msg', 'invalid')}"
    return error_response(422, "invalid_request_error", message, param=where or None, code="invalid_value")


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes is a 413 before any of it is parsed."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            reply = error_response(
                413, "request_too_large", f"the body is over {self.limit} bytes", code="request_too_large"
            )
            return await reply(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, f"the body is over {self.limit} bytes")
            return message

        await self.app(scope, limited, send)
