"""The runtime every dockyard service and client shares.

settings.py   ServiceSettings: host, port, limits; DOCKYARD_<SERVICE>_* from the environment
logging.py    structlog JSON logs with request and job ids bound per RPC
errors.py     domain errors that map onto gRPC status codes
server.py     grpc.aio server: health, reflection, interceptors, graceful SIGTERM
client.py     channels with size limits, a deadline on every call, retries for idempotent RPCs
auth.py       shared bearer token (server interceptor, client metadata) and optional mutual TLS
"""
