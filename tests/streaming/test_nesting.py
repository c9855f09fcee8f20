"""How deep a request may nest (streaming/pipeline/nesting.py), and the gRPC edge's answer to a
message nested past protobuf's limit, against the real grpcio server and pipeline. The
WebSocket's frames: tests/resilience/test_websocket_fuzz.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from sluice.errors import BadRequest
from streaming.pipeline.nesting import MAX_JSON_DEPTH, check_depth, json_depth
from streaming.protos import inference_pb2 as pb
from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live
from tests.streaming.test_grpc import call


def _nested(depth: int) -> object:
    value: object = "leaf"
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def test_depth_counts_containers_without_recursing() -> None:
    values: list[object] = ["x", [], {}, [{}], {"a": [1, {"b": []}]}]
    assert [json_depth(v) for v in values] == [0, 1, 1, 2, 4]
    # Far past Python's recursion limit, counted only as far as it matters.
    assert json_depth(_nested(100_000), stop_after=64) == 65
    assert json_depth(_nested(100_000), stop_after=10**6) == 100_000


def test_a_body_past_the_limit_is_a_typed_400() -> None:
    check_depth(_nested(MAX_JSON_DEPTH))
    with pytest.raises(BadRequest) as caught:
        check_depth(_nested(MAX_JSON_DEPTH + 1))
    assert caught.value.status == 400 and caught.value.code == "json_too_deep"


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field, encoded by hand: protobuf's own encoder
    refuses to build what its decoder would refuse."""
    size, varint = len(payload), b""
    while size > 0x7F:
        varint += bytes([size & 0x7F | 0x80])
        size >>= 7
    return bytes([number << 3 | 2]) + varint + bytes([size]) + payload


def _deep_tool_request(depth: int) -> bytes:
    """A ChatRequest whose tool's `parameters` Struct holds `depth` lists in lists."""
    value = _field(3, b"leaf")  # Value.string_value
    for _ in range(depth):
        value = _field(6, _field(1, value))  # Value.list_value, ListValue.values
    struct = _field(1, _field(1, b"x") + _field(2, value))  # Struct.fields {"x": value}
    tool = _field(1, b"function") + _field(2, _field(1, b"f") + _field(3, struct))
    base = pb.ChatRequest(model="echo", messages=[pb.ChatMessage(role="user", content="hi")])
    return base.SerializeToString() + _field(8, tool)  # ChatRequest.tools


@pytest.mark.slow
def test_a_grpc_message_nested_too_deep_is_invalid_argument(live: Live,
                                                            grpc_target: str) -> None:
    """Given a developer, when a Chat or ChatStream request's Struct nests past
    protobuf's limit (60 and 100,000 levels), then the call fails INVALID_ARGUMENT with
    error-code json_too_deep (not UNKNOWN, a server error), and the server then still
    answers a call."""
    key = make_org("grpcdeep", [Role.DEVELOPER]).keys[Role.DEVELOPER]

    async def attempt(method: str, raw: bytes) -> tuple[grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            path = f"/sluice.v1.Inference/{method}"
            auth = (("authorization", f"Bearer {key}"),)
            try:
                if method == "Chat":
                    await channel.unary_unary(path)(raw, metadata=auth, timeout=30)
                else:
                    async for _ in channel.unary_stream(path)(raw, metadata=auth,
                                                              timeout=30):
                        pass
            except grpc.aio.AioRpcError as error:
                trailing = dict(error.trailing_metadata() or ())
                return error.code(), str(trailing.get("error-code"))
            return grpc.StatusCode.OK, ""
    answers = [asyncio.run(attempt(method, _deep_tool_request(depth)))
               for method in ("Chat", "ChatStream") for depth in (60, 100_000)]
    assert answers == [(grpc.StatusCode.INVALID_ARGUMENT, "json_too_deep")] * 4
    reply = call(grpc_target, "Chat", pb.ChatRequest(model="echo", messages=[
        pb.ChatMessage(role="user", content="still here")]), key=key)
    assert reply.message.content == "still here"
