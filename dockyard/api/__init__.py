"""Generated protobuf and gRPC stubs, and nothing else (protos/generate.py writes them).

    dockyard/api/<service>/v1/<service>_pb2.py       messages     (wire package dockyard.<service>.v1)
    dockyard/api/<service>/v1/<service>_pb2_grpc.py  stubs and servicer bases

Never edit these files: change the protos and run `make protos`; a contract
test fails when the committed stubs drift from the protos.
"""
