"""Authentication between services: a shared bearer token, and optionally mutual TLS.

    client --[authorization: Bearer <token>]--> TokenAuthInterceptor --> RpcContextInterceptor --> servicer
                                                  refuses a missing or wrong token with UNAUTHENTICATED

One set of variables, read the same way by every service and every client
(CLI, coordinator -> peers, trainer -> buffer/coordinator, rollout -> coordinator):

    DOCKYARD_AUTH_TOKEN        the token itself, or
    DOCKYARD_AUTH_TOKEN_FILE   a file holding it (a mounted secret); surrounding whitespace is dropped
    DOCKYARD_TLS_CERT/KEY/CA   PEM files: this process's certificate and key, and the CA that signs
                               every peer's; all three or none. Servers then require client certificates.
    DOCKYARD_TLS_SERVER_NAME   name to check in the server's certificate instead of the dialled host

Guarantees: nothing configured means the previous behaviour (plaintext, no
token). A bad setting (both token variables, a missing or empty token file, a
token that is not a valid header value, an incomplete TLS triple, a missing
PEM file) fails when the settings are read, at startup, with an AuthConfigError
naming the variable and never the token. Tokens are compared in constant time.
Two services stay open: the standard health service, so container health
checks, kubelet gRPC probes and load balancers need no token, and server
reflection, which only describes the protos the repository publishes anyway
(and which grpcurl needs to call even the health service). Every dockyard
method needs the token (grpcurl: `-H "authorization: Bearer $TOKEN"`).
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import grpc
import structlog
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

log = structlog.get_logger()

AUTH_METADATA_KEY = "authorization"
# Methods anyone may call: health checkers (kubelet gRPC probes, compose, load balancers) carry no
# token, and reflection only describes the published protos (grpcurl reads it before any call).
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/")
# A token travels as an HTTP/2 header value: printable ASCII without spaces.
_TOKEN = re.compile(r"^[\x21-\x7e]+$")


class AuthConfigError(RuntimeError):
    """A security setting is unusable. Not a ValueError, so pydantic never wraps it with the input (the token)."""


class AuthSettings(BaseSettings):
    """DOCKYARD_AUTH_* and DOCKYARD_TLS_*: one set shared by every service and client."""

    model_config = SettingsConfigDict(env_prefix="DOCKYARD_", extra="ignore", hide_input_in_errors=True)

    auth_token: str = Field("", repr=False, description="Shared bearer token; empty = no token auth.")
    auth_token_file: str = Field("", description="File holding the shared token (a mounted secret).")
    tls_cert: str = Field("", description="PEM certificate of this process (server and client).")
    tls_key: str = Field("", description="PEM private key of tls_cert.")
    tls_ca: str = Field("", description="PEM CA bundle that signs every peer's certificate.")
    tls_server_name: str = Field("", description="Name checked in servers' certificates instead of the host.")

    @model_validator(mode="after")
    def _check(self) -> AuthSettings:
        _ = self.token  # reads and checks the token file now, at startup
        tls = {"DOCKYARD_TLS_CERT": self.tls_cert, "DOCKYARD_TLS_KEY": self.tls_key, "DOCKYARD_TLS_CA": self.tls_ca}
        given = [name for name, value in tls.items() if value]
        if given and len(given) != len(tls):
            missing = sorted(set(tls) - set(given))
            raise AuthConfigError(f"TLS needs DOCKYARD_TLS_CERT, _KEY and _CA together; missing: {', '.join(missing)}")
        for name, value in tls.items():
            if value and not Path(value).is_file():
                raise AuthConfigError(f"{name}={value}: no such file")
        if self.tls_server_name and not given:
            raise AuthConfigError("DOCKYARD_TLS_SERVER_NAME is set but TLS is not (DOCKYARD_TLS_CERT/KEY/CA)")
        return self

    @cached_property
    def token(self) -> str | None:
        """The shared token, or None when token auth is off."""
        if self.auth_token and self.auth_token_file:
            raise AuthConfigError("set DOCKYARD_AUTH_TOKEN or DOCKYARD_AUTH_TOKEN_FILE, not both")
        if self.auth_token_file:
            path = Path(self.auth_token_file)
            try:
                token = path.read_text(encoding="utf-8").strip()
            except FileNotFoundError:
                raise AuthConfigError(f"DOCKYARD_AUTH_TOKEN_FILE={path}: no such file") from None
            except (OSError, UnicodeDecodeError) as exc:
                reason = type(exc).__name__
                raise AuthConfigError(f"DOCKYARD_AUTH_TOKEN_FILE={path}: cannot read it ({reason})") from None
            source = f"DOCKYARD_AUTH_TOKEN_FILE={path}"
            if not token:
                raise AuthConfigError(f"{source}: the file is empty")
        else:
            token, source = self.auth_token, "DOCKYARD_AUTH_TOKEN"
            if not token:
                return None
        if not _TOKEN.match(token):
            raise AuthConfigError(f"{source}: the token must be printable ASCII without spaces")
        return token

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def _pem(self) -> tuple[bytes, bytes, bytes]:
        return Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes(), Path(self.tls_ca).read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """mTLS server credentials (client certificates required), or None for plaintext."""
        if not self.tls:
            return None
        key, cert, ca = self._pem()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """mTLS channel credentials presenting this process's certificate, or None for plaintext."""
        if not self.tls:
            return None
        key, cert, ca = self._pem()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.tls_server_name)] if self.tls_server_name else []


def load_auth_settings() -> AuthSettings:
    """The shared security settings from the environment; AuthConfigError when unusable."""
    return AuthSettings()


def bearer(token: str) -> str:
    return f"Bearer {token}"


@dataclass(frozen=True)
class _Refusal:
    message: str

    async def unary(self, request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, self.message)

    def handler(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""
        serde = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self.unary, **serde)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self.unary, **serde)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self.unary, **serde)
        return grpc.stream_stream_rpc_method_handler(self.unary, **serde)


MISSING_TOKEN = _Refusal(
    "missing credentials: this server requires 'authorization: Bearer <token>' metadata "
    "(clients read the token from DOCKYARD_AUTH_TOKEN or DOCKYARD_AUTH_TOKEN_FILE)"
)
WRONG_TOKEN = _Refusal("invalid credentials: the bearer token does not match this server's DOCKYARD_AUTH_TOKEN")


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only with the right bearer token; health checks always pass."""

    def __init__(self, token: str) -> None:
        self._expected = bearer(token).encode()

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        given = [v for k, v in handler_call_details.invocation_metadata or () if k == AUTH_METADATA_KEY]
        if len(given) == 1:
            value = given[0].encode() if isinstance(given[0], str) else given[0]
            if hmac.compare_digest(value, self._expected):
                return await continuation(handler_call_details)
            refusal = WRONG_TOKEN
        else:
            refusal = WRONG_TOKEN if given else MISSING_TOKEN  # several values: refused, never guessed between
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: UNIMPLEMENTED reveals nothing a token would protect
        log.warning("rpc refused", rpc=method, code="UNAUTHENTICATED", reason=refusal.message.split(":")[0])
        return refusal.handler(handler)
