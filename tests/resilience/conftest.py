"""The live gateway (uvicorn + in-thread workers) and its gRPC server, for the hostile
client tests."""

from tests.streaming.conftest import grpc_target, live  # noqa: F401
