"""Protobuf and gRPC stubs for protos/zero_ray/v1, written by
``python -m zero_ray.control.codegen``. Never edit the ``*_pb2*`` files by hand:
change the ``.proto`` sources and regenerate (a test fails when they drift)."""
