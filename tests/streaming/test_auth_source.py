"""Wrong API keys on the WebSocket and over gRPC count against the client's address, as
on REST (tests/tenants/test_throttle.py): past the threshold its keys are refused with
a 429 (RESOURCE_EXHAUSTED) before they are checked."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import websockets

from sluice.redis import sync_redis
from streaming.protos import inference_pb2 as pb
from streaming.protos import inference_pb2_grpc as pb_grpc
from tenants import cache as auth_cache
from tenants import throttle
from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
THRESHOLD = 4


@pytest.fixture
def guessed_keys(live: Live, settings: Any) -> Iterator[list[str]]:
    """Wrong secrets of a real key's prefix, with the per-source threshold at 4; every
    counter and lock is forgotten afterwards (all these clients are 127.0.0.1)."""
    settings.SLUICE_AUTH_SOURCE_FAILURES = THRESHOLD
    settings.SLUICE_AUTH_BACKOFF_S = settings.SLUICE_AUTH_BACKOFF_MAX_S = 30
    prefix = make_org("alice", [Role.DEVELOPER]).keys[Role.DEVELOPER].split("-")[2]
    yield [f"sk-sluice-{prefix}-GUESSEDSECRET{i:04d}" for i in range(THRESHOLD + 2)]
    for key in list(sync_redis().scan_iter("sluice:auth:*")):
        if key != b"sluice:auth:epoch":
            sync_redis().delete(key)
    throttle.clear()
    auth_cache.clear()


def test_wrong_keys_on_the_websocket_are_throttled_per_source(
        live: Live, guessed_keys: list[str]) -> None:
    url = live.base_url.replace("http://", "ws://") + "/chat/socket"

    async def status(key: str) -> int:
        async with websockets.connect(url, additional_headers={
                "Authorization": f"Bearer {key}"}) as ws:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 20))
            return int({"authentication_error": 401,
                        "rate_limit_error": 429}[frame["error"]["type"]])

    async def go() -> list[int]:
        return [await status(key) for key in guessed_keys]

    assert asyncio.run(go()) == [401] * (THRESHOLD - 1) + [429] * 3


def test_wrong_keys_over_grpc_are_throttled_per_source(
        grpc_target: str, guessed_keys: list[str]) -> None:
    async def go() -> list[grpc.StatusCode]:
        codes = []
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            for key in guessed_keys:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.ListModels(pb.ListModelsRequest(), timeout=20,
                                          metadata=(("authorization", f"Bearer {key}"),))
                codes.append(refused.value.code())
        return codes

    assert asyncio.run(go()) == [grpc.StatusCode.UNAUTHENTICATED] * (THRESHOLD - 1) + \
        [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3
