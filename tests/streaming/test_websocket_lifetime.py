"""How long a chat socket (/v1/chat/socket) lives, over real sockets to the live uvicorn server
(workers, Redis): idle for a minute, through a generation far longer than Redis's
socket timeouts, and what its handshake answers (streaming/transports/websocket.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest
import websockets
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from websockets.asyncio.client import ClientConnection
from websockets.frames import Frame, Opcode

from streaming.pipeline.gateway import shared_gateway
from streaming.transports.websocket import RealtimeConsumer
from tenants.roles import Role
from tenants.services import apikey_revoke
from tests.conftest import Org, make_org, principal_for
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

IDLE_S = 60.0  # the requirement: a socket held a minute by the clock
SLOW_TOKEN_S = 0.05  # slow-echo's per-token delay (tests/streaming/conftest.py)


class PingCounting(ClientConnection):
    """A client connection that counts the protocol-level pings the server sends."""

    pings = 0

    def process_event(self, event: Any) -> None:
        if isinstance(event, Frame) and event.opcode is Opcode.PING:
            self.pings += 1
        super().process_event(event)


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("wslife", [Role.DEVELOPER])


def _url(live: Live) -> str:
    return live.base_url.replace("http://", "ws://") + "/chat/socket"


def _chat(rid: str, text: str, model: str = "echo") -> str:
    return json.dumps({"type": "chat.request", "id": rid, "request": {
        "model": model, "messages": [{"role": "user", "content": text}]}})


async def _reply(ws: ClientConnection, rid: str, timeout: float = 20) -> list[dict[str, Any]]:
    """The frames of request `rid` up to its final one."""
    frames = []
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if frame.get("id") == rid:
            frames.append(frame)
            if frame["type"] in ("chat.done", "error"):
                return frames


@pytest.mark.single_redis("an idle minute touches no Redis; the call after it is any call")
def test_an_idle_socket_stays_open_a_minute_gets_pings_and_still_answers(
        live: Live, org: Org) -> None:
    """Given a developer's socket on which the client itself never pings, when it sits
    idle for a minute, then nothing closes it, the server kept it alive with
    protocol-level pings (what proxies need to keep an idle connection), and it still
    serves a request."""
    async def go() -> tuple[float, int, list[dict[str, Any]]]:
        async with websockets.connect(
                _url(live), ping_interval=None, create_connection=PingCounting,
                additional_headers={"Authorization": f"Bearer {org.keys[Role.DEVELOPER]}"}
        ) as ws:
            assert isinstance(ws, PingCounting)
            opened = time.monotonic()
            while (left := opened + IDLE_S - time.monotonic()) > 0:
                try:
                    frame = await asyncio.wait_for(ws.recv(), left)
                except TimeoutError:
                    break  # the minute passed with the socket open
                except websockets.ConnectionClosed as closed:
                    pytest.fail(f"closed after {time.monotonic() - opened:.1f} s: "
                                f"{closed.rcvd}")
                pytest.fail(f"an unasked-for frame: {frame!r}")
            held = time.monotonic() - opened
            await ws.send(_chat("after", "a minute later"))
            return held, ws.pings, await _reply(ws, "after")
    held, pings, frames = asyncio.run(go())
    assert held >= IDLE_S
    assert pings >= 1
    assert "".join(f.get("delta", "") for f in frames) == "a minute later"
    assert frames[-1]["type"] == "chat.done"


def test_a_channel_layer_receive_outwaits_its_blocking_read(db: None) -> None:
    """Given the Channels layer as configured, when a receive waits longer than one of
    its blocking Redis reads (5 s, as long as redis-py's default socket timeout) before
    a message comes, then it gets the message, not a Redis TimeoutError."""
    layer = get_channel_layer()
    assert layer is not None

    async def go() -> dict[str, Any]:
        name = await layer.new_channel()

        async def later() -> None:
            await asyncio.sleep(6)  # the stimulus: a message only after one read's block
            await layer.send(name, {"type": "late"})
        sender = asyncio.create_task(later())
        try:
            return dict(await asyncio.wait_for(layer.receive(name), 20))
        finally:
            await sender
            await layer.close_pools()
    assert asyncio.run(go())["type"] == "late"


def test_a_generation_longer_than_the_redis_timeouts_arrives_whole(
        live: Live, org: Org) -> None:
    """Given a request on slow-echo whose reply takes about 10 s (twice the 5 s socket
    timeout that used to cut sockets mid-generation), when it runs, then every delta
    and the final frame arrive on the same socket."""
    text = "".join(chr(ord("a") + i % 26) for i in range(200))

    async def go() -> tuple[float, list[dict[str, Any]]]:
        async with websockets.connect(_url(live), additional_headers={
                "Authorization": f"Bearer {org.keys[Role.DEVELOPER]}"}) as ws:
            began = time.monotonic()
            await ws.send(_chat("long", text, model="slow-echo"))
            frames = await _reply(ws, "long", timeout=30)
            return time.monotonic() - began, frames
    took, frames = asyncio.run(go())
    assert took >= len(text) * SLOW_TOKEN_S * 0.9, "the generation was not long"
    assert [f["type"] for f in frames][-1] == "chat.done", frames[-1]
    assert "".join(f.get("delta", "") for f in frames) == text
    assert frames[-1]["usage"]["completion_tokens"] == len(text)


def test_the_subprotocol_answer_names_no_key(live: Live, org: Org) -> None:
    """Given a browser-style sign-in (the key in a subprotocol, beside the fixed
    `sluice.v1`), when the socket opens, then the server answers `sluice.v1`, no
    response header carries the key, and the socket serves requests. A client that
    offers only the key's subprotocol still signs in, and gets no subprotocol back."""
    key = org.keys[Role.DEVELOPER]

    async def go(offered: list[str]) -> tuple[str | None, str, list[dict[str, Any]]]:
        async with websockets.connect(_url(live), subprotocols=offered,  # type: ignore[arg-type]
                                      ) as ws:
            assert ws.response is not None
            headers = "\n".join(f"{k}: {v}" for k, v in ws.response.headers.raw_items())
            await ws.send(_chat("p", "signed in"))
            return ws.subprotocol, headers, await _reply(ws, "p")
    chosen, headers, frames = asyncio.run(go(["sluice.v1", f"sluice.bearer.{key}"]))
    assert chosen == "sluice.v1"
    assert key not in headers and key[-12:] not in headers
    assert frames[-1]["type"] == "chat.done"
    chosen, headers, frames = asyncio.run(go([f"sluice.bearer.{key}"]))
    assert chosen is None and key[-12:] not in headers
    assert frames[-1]["type"] == "chat.done"


def test_a_revoked_key_is_refused_at_the_sockets_next_request(live: Live, org: Org) -> None:
    """Given an open socket that signed in with a key, when the key is revoked, then the
    socket's next request gets an authentication error frame and the socket closes
    with 4401, as a REST call with that key would be refused: a socket that lives for
    hours holds no credential longer than the credential is good."""
    key = org.keys[Role.DEVELOPER]

    def revoke() -> None:
        apikey_revoke(actor=principal_for(org.members[Role.DEVELOPER]),
                      key_id=org.key_rows[Role.DEVELOPER].pk)

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]], int | None]:
        async with websockets.connect(_url(live), additional_headers={
                "Authorization": f"Bearer {key}"}) as ws:
            await ws.send(_chat("a", "yes"))
            before = await _reply(ws, "a")
            await asyncio.to_thread(revoke)
            # The gateway's cache drops a revoked key within about a second
            # (tenants/cache.py): ask until it is refused, for at most 10 s.
            deadline, n = time.monotonic() + 10, 0
            while True:
                n += 1
                await ws.send(_chat(f"b{n}", "still?"))
                after = await _reply(ws, f"b{n}")
                if after[-1]["type"] == "error" or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            try:
                await asyncio.wait_for(ws.recv(), 10)
            except websockets.ConnectionClosed as closed:
                return before, after, closed.rcvd.code if closed.rcvd else None
            return before, after, None
    before, after, code = asyncio.run(go())
    assert before[-1]["type"] == "chat.done"
    assert after[-1]["type"] == "error"
    assert after[-1]["error"]["type"] == "authentication_error"
    assert code == 4401


class FailingConsumer(RealtimeConsumer):
    """The real consumer, whose frame handling fails as a bug in it would."""

    async def receive(self, text_data: str | None = None,
                      bytes_data: bytes | None = None) -> None:
        raise RuntimeError("a bug in the frame handling")


def test_an_unexpected_error_closes_the_socket_with_1011_and_is_logged(
        live: Live, org: Org, caplog: pytest.LogCaptureFixture) -> None:
    """Given a signed-in socket whose consumer fails unexpectedly on a frame, then the
    socket gets a close frame with 1011 (internal error), not a dropped connection,
    and the failure is logged with its traceback."""
    app = FailingConsumer.as_asgi()

    async def go() -> dict[str, Any]:
        try:
            ws = WebsocketCommunicator(app, "/v1/chat/socket", headers=[
                (b"authorization", f"Bearer {org.keys[Role.DEVELOPER]}".encode())])
            assert (await ws.connect())[0]
            await ws.send_to(text_data=_chat("x", "boom"))
            return dict(await ws.receive_output(timeout=10))
        finally:
            await shared_gateway().close()
    with caplog.at_level(logging.ERROR, logger="sluice.streaming"):
        closed = asyncio.run(go())
    assert closed == {"type": "websocket.close", "code": 1011}
    assert [r.levelno for r in caplog.records if r.name == "sluice.streaming"] == [
        logging.ERROR]
    assert "RuntimeError: a bug in the frame handling" in caplog.text  # the traceback
