"""`python -m dockyard.rpc.probe HOST:PORT [SERVICE]`: one grpc.health.v1 Check, for container health checks.

Exits 0 when the server answers SERVING for SERVICE (the whole server when
omitted), 1 otherwise (NOT_SERVING, draining, refused, or no answer within
--timeout seconds). Imports only grpc and the health stubs, so it is cheap
enough to run every few seconds.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of the service")
    parser.add_argument("service", nargs="?", default="", help="service name; empty: the whole server")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    return 0 if check(args.address, args.service, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
