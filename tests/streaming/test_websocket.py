"""The WebSocket adapter: Channels' communicator against the real ASGI application and
pipeline (workers, Redis), and one real socket over the live uvicorn server."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
import websockets
from channels.testing import WebsocketCommunicator

from governance import audit
from governance.models import AuditEvent
from sluice.root.asgi import application
from streaming.pipeline.gateway import shared_gateway
from tenants.roles import Role
from tests.conftest import Org, make_org
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
T = TypeVar("T")


def in_loop(go: Callable[[], Awaitable[T]]) -> T:
    """Run a communicator scenario in a fresh event loop. The consumers' gateway state
    for that loop (its Redis client, result router and recorder) is closed before the
    loop ends: settled and written, with nothing left for the loop's teardown to cancel."""
    async def main() -> T:
        try:
            return await go()
        finally:
            await shared_gateway().close()

    return asyncio.run(main())


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("wsorg", [Role.DEVELOPER, Role.AUDITOR])


def socket(key: str | None = None, subprotocols: list[str] | None = None
           ) -> WebsocketCommunicator:
    headers = [(b"host", b"127.0.0.1")]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    return WebsocketCommunicator(application, "/v1/chat/socket", headers=headers,
                                 subprotocols=subprotocols)


async def frames_until(ws: WebsocketCommunicator, done: set[str],
                       timeout: float = 20) -> list[dict[str, Any]]:
    """Frames until every id in `done` got its final frame."""
    out: list[dict[str, Any]] = []
    waiting = set(done)
    while waiting:
        frame = json.loads(await ws.receive_from(timeout=timeout))
        out.append(frame)
        if frame["type"] in ("chat.done", "embeddings.result", "error"):
            waiting.discard(frame["id"])
    return out


def chat(rid: str, text: str, model: str = "echo") -> str:
    return json.dumps({"type": "chat.request", "id": rid, "request": {
        "model": model, "messages": [{"role": "user", "content": text}]}})


def test_auth_at_connect(org: Org) -> None:
    async def go() -> tuple[Any, ...]:
        anon = socket()
        assert (await anon.connect())[0]
        first = json.loads(await anon.receive_from())
        closed = await anon.receive_output()
        auditor = socket(org.keys[Role.AUDITOR])
        await auditor.connect()
        denied = json.loads(await auditor.receive_from())
        closed2 = await auditor.receive_output()
        return first, closed, denied, closed2
    first, closed, denied, closed2 = in_loop(go)
    assert first["type"] == "error" and first["error"]["type"] == "authentication_error"
    assert closed == {"type": "websocket.close", "code": 4401}
    assert denied["error"]["type"] == "permission_error" and closed2["code"] == 4403


def test_concurrent_requests_on_one_socket(org: Org) -> None:
    async def go() -> list[dict[str, Any]]:
        ws = socket(org.keys[Role.DEVELOPER])
        await ws.connect()
        await ws.send_to(text_data=chat("a", "first request"))
        await ws.send_to(text_data=chat("b", "second one"))
        await ws.send_to(text_data=json.dumps({"type": "embeddings.request", "id": "e",
                                               "request": {"model": "minilm",
                                                           "input": ["x"]}}))
        frames = await frames_until(ws, {"a", "b", "e"})
        await ws.disconnect()
        return frames
    frames = in_loop(go)
    text = {rid: "".join(f["delta"] for f in frames if f["id"] == rid and
                         f["type"] == "chat.delta") for rid in ("a", "b")}
    assert text == {"a": "first request", "b": "second one"}
    done = {f["id"]: f for f in frames if f["type"] == "chat.done"}
    assert done["a"]["finish_reason"] == "stop" and done["b"]["usage"]["completion_tokens"] == 10
    emb = next(f for f in frames if f["type"] == "embeddings.result")
    assert len(emb["body"]["data"][0]["embedding"]) == 384


def test_bad_frames_get_errors_and_the_socket_stays(org: Org) -> None:
    async def go() -> list[dict[str, Any]]:
        ws = socket(subprotocols=["sluice.v1", f"sluice.bearer.{org.keys[Role.DEVELOPER]}"])
        connected, subprotocol = await ws.connect()
        assert connected and subprotocol == "sluice.v1"
        out = []
        for frame in ["not json", json.dumps({"type": "chat.request"}),
                      json.dumps({"type": "dance", "id": "x"}),
                      json.dumps({"type": "chat.request", "id": "m",
                                  "request": {"model": "nope", "messages": [
                                      {"role": "user", "content": "hi"}]}}),
                      json.dumps({"type": "chat.request", "id": "v",
                                  "request": {"model": "echo", "messages": []}})]:
            await ws.send_to(text_data=frame)
            out.append(json.loads(await ws.receive_from(timeout=10)))
        await ws.send_to(text_data=chat("ok", "still here"))
        out += await frames_until(ws, {"ok"})
        await ws.disconnect()
        return out
    out = in_loop(go)
    assert [f["type"] for f in out[:5]] == ["error"] * 5
    assert out[0]["error"]["code"] == "invalid_json" and out[1]["error"]["param"] == "id"
    assert out[3]["id"] == "m" and out[3]["error"]["code"] == "model_not_found"
    assert out[4]["id"] == "v" and out[4]["error"]["param"] == "messages"
    assert out[-1]["type"] == "chat.done"


def test_cancel_frame_and_disconnect_stop_the_generation(org: Org, live: Live) -> None:
    worker = live.workers["slow-echo"]

    async def go() -> list[dict[str, Any]]:
        ws = socket(org.keys[Role.DEVELOPER])
        await ws.connect()
        await ws.send_to(text_data=chat("long", "w" * 300, model="slow-echo"))
        first = json.loads(await ws.receive_from(timeout=10))
        await ws.send_to(text_data=json.dumps({"type": "cancel", "id": "long"}))
        deadline = time.monotonic() + 10
        while worker.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cancelled_in_time = not worker.active
        await ws.send_to(text_data=chat("gone", "v" * 300, model="slow-echo"))
        # "long" may have sent more deltas before its cancel landed: wait for "gone"'s.
        while json.loads(await ws.receive_from(timeout=10))["id"] != "gone":
            pass
        await ws.disconnect()
        deadline = time.monotonic() + 10
        while worker.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        after_close = not worker.active
        return [first, {"cancelled": cancelled_in_time, "after_close": after_close}]
    first, result = in_loop(go)
    assert first["type"] == "chat.delta"
    assert result == {"cancelled": True, "after_close": True}
    audit.drain()
    assert AuditEvent.objects.filter(tenant__slug="wsorg", protocol="websocket").exists()


def test_a_real_socket_over_the_live_server(live: Live, org: Org) -> None:
    url = live.base_url.replace("http://", "ws://") + "/chat/socket"

    async def go() -> list[dict[str, Any]]:
        async with websockets.connect(url, additional_headers={
                "Authorization": f"Bearer {org.keys[Role.DEVELOPER]}"}) as ws:
            await ws.send(chat("live", "over the wire"))
            frames = []
            while True:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 20))
                frames.append(frame)
                if frame["type"] in ("chat.done", "error"):
                    return frames
    frames = asyncio.run(go())
    assert "".join(f.get("delta", "") for f in frames) == "over the wire"
    assert frames[-1]["type"] == "chat.done"
