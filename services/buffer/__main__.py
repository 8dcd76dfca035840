"""Entry point of the buffer service: `dockyard-buffer` or `python -m services.buffer`.

Settings come from DOCKYARD_BUFFER_* variables; the servicer and backend are
imported inside `build`, so a bad setting fails before anything heavy loads.
"""

from __future__ import annotations

from dockyard.rpc.launch import run_service
from dockyard.rpc.server import Service
from services.buffer.settings import BufferSettings


def main() -> None:
    from dockyard.redis_url import RedisConfigError

    try:
        settings = BufferSettings()
    except RedisConfigError as exc:
        raise SystemExit(f"buffer: {exc}") from None

    async def build():
        from dockyard.api.buffer.v1 import buffer_pb2_grpc
        from services.buffer.backend import BufferBackend
        from services.buffer.servicer import BufferServicer

        backend: BufferBackend
        if settings.backend == "redis":
            from redis.exceptions import ConnectionError as RedisConnectionError

            from dockyard.redis_url import RedisAuthError, mask_secret, mask_url
            from services.buffer.redis_backend import RedisBuffer

            # Ping at startup: a bad URL or password fails here, not at the first put.
            try:
                backend = await RedisBuffer.connect(settings.redis_url, password=settings.redis_password_value)
            except RedisAuthError as exc:
                raise SystemExit(f"buffer: {exc}") from None
            except (RedisConnectionError, OSError) as exc:
                reason = mask_secret(str(exc), settings.redis_password_value)
                raise SystemExit(f"buffer: cannot reach Redis at {mask_url(settings.redis_url)}: {reason}") from None
        else:
            from services.buffer.memory import MemoryBuffer

            backend = MemoryBuffer()
        servicer = BufferServicer(
            backend,
            max_group_bytes=int(settings.max_group_mb * 2**20),
            max_message_bytes=settings.max_message_mb * 2**20,
            max_trajectory_tokens=settings.max_trajectory_tokens,
            data_plane_url=settings.advertised_data_plane_url,
            staging_ttl_seconds=settings.staging_ttl_seconds,
        )
        service = Service(
            name="dockyard.buffer.v1.BufferService",
            servicer=servicer,
            add_to_server=buffer_pb2_grpc.add_BufferServiceServicer_to_server,
        )
        return [service], backend.close

    run_service("buffer", settings, build)


if __name__ == "__main__":
    main()
