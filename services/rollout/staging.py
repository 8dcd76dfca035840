"""The rollout's side of the experience data plane: a Generate that names one stages its group's payload.

    Generate(staging: the buffer's data plane, group id) ─engine─> result
        ─PayloadStager.stage─> single_turn.stage (pack, check, SET EX ttl) ─> (key, bytes) for the response
                              └ None: no connection, Redis error, payload refused ─> arrays in the response

Guarantees: one connection per advertised data plane, kept for the replica's life (closed by `close`); the
password is read here (DOCKYARD_DATA_PLANE_REDIS_PASSWORD[_FILE]), never carried by an RPC, and sent only to
a Redis DOCKYARD_DATA_PLANE_REDIS_HOSTS lists (DataPlane.connect_named); a data plane that could not be
reached is not tried again for Planes.RETRY_AFTER_S, so an unreachable Redis delays no more than one
Generate in that time; every failure to stage is logged with its cause and answered with None, so the caller
gets the arrays and nothing generated is lost.
"""

from __future__ import annotations

import structlog
from redis.exceptions import RedisError

from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.experience import single_turn
from dockyard.experience.data_plane import Planes
from dockyard.experience.routing_layout import to_bytes
from dockyard.rpc.errors import InvalidArgument
from services.rollout.engine import GenerationResult

log = structlog.get_logger()


def result_routing(result: GenerationResult | None) -> single_turn.Routing | None:
    """A result's routing as the trajectories carry it (each completion's prompt and completion rows); None
    for no result or a dense policy's."""
    if result is None or result.routing_shape is None:
        return None
    shape = result.routing_shape
    wire = common_pb2.RoutingShape(moe_layers=shape.moe_layers, top_k=shape.top_k, num_experts=shape.num_experts)
    rows = [to_bytes(c.prompt_routing, shape) + to_bytes(c.routing, shape) for c in result.completions]
    return wire, rows


class PayloadStager:
    def __init__(self) -> None:
        self._planes = Planes()

    async def stage(
        self,
        job_id: str,
        staging: rollout_pb2.PayloadStaging,
        result: GenerationResult,
        routing: GenerationResult | None = None,
    ) -> tuple[str, int] | None:
        """The group's payload staged where `staging` says: (key, bytes); None where it could not be.
        `routing`: the result, when its routing goes with the tokens (GenerateRequest.return_routing)."""
        plane = await self._planes.get(staging.data_plane)
        if plane is None:
            return None
        try:
            return await single_turn.stage(
                plane, job_id, staging.group_id, result.prompt_token_ids, result.completions, result_routing(routing)
            )
        except InvalidArgument as exc:
            # The caller's own check (without a data plane, the buffer's) refuses it again, naming the same fault.
            log.warning("payload not staged: it fails the buffer's checks", group=staging.group_id, error=str(exc))
        except (RedisError, OSError) as exc:
            log.warning("payload not staged: the data plane's Redis failed", group=staging.group_id, error=repr(exc))
        return None

    async def close(self) -> None:
        await self._planes.close()
