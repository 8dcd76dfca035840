"""The services' default ports, importable without pydantic so `dockyard --help` answers at once.

Guarantees: one port per service, distinct; `default_address` is loopback on that port.
"""

DEFAULT_PORTS = {
    "coordinator": 50051,
    "trainer": 50052,
    "rollout": 50053,
    "buffer": 50054,
    "sandbox": 50055,
}


def default_address(service: str) -> str:
    return f"127.0.0.1:{DEFAULT_PORTS[service]}"
