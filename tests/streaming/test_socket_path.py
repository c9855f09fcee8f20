"""Our chat socket has a path of its own (`/v1/chat/socket`); `/v1/realtime`, OpenAI's
Realtime API path, tells an OpenAI Realtime client (the official SDK, or a browser's
subprotocols) that this server does not speak that API, and still serves our own
clients, pointing them to the new path. Real sockets to the live uvicorn server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from streaming.transports.realtime_refusal import CHAT_SOCKET_PATH, CLOSE_NOT_REALTIME
from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live

pytestmark = pytest.mark.slow


@pytest.fixture
def key(live: Live) -> str:
    return make_org("sockpath", [Role.DEVELOPER]).keys[Role.DEVELOPER]


def ws_url(live: Live, path: str) -> str:
    return live.base_url.replace("http://", "ws://").removesuffix("/v1") + path


async def chat_over(ws: Any, text: str) -> list[dict[str, Any]]:
    await ws.send(json.dumps({"type": "chat.request", "id": "r1", "request": {
        "model": "echo", "messages": [{"role": "user", "content": text}]}}))
    frames = []
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), 20))
        frames.append(frame)
        if frame["type"] in ("chat.done", "error"):
            return frames


def test_our_socket_answers_on_its_own_path(live: Live, key: str) -> None:
    # given a key, when a chat runs over a socket on /v1/chat/socket
    async def go() -> list[dict[str, Any]]:
        async with websockets.connect(ws_url(live, CHAT_SOCKET_PATH), additional_headers={
                "Authorization": f"Bearer {key}"}) as ws:
            assert ws.response is not None and "link" not in ws.response.headers
            return await chat_over(ws, "on the new path")

    frames = asyncio.run(go())
    # then the reply streams back as before
    assert "".join(f.get("delta", "") for f in frames) == "on the new path"
    assert frames[-1]["type"] == "chat.done"


def test_our_clients_on_the_old_path_still_work_and_are_pointed_to_the_new_one(
        live: Live, key: str) -> None:
    # given one of our clients on /v1/realtime (a browser's subprotocol sign-in)
    async def go() -> tuple[str, list[dict[str, Any]]]:
        async with websockets.connect(ws_url(live, "/v1/realtime"), subprotocols=[
                "sluice.v1", f"sluice.bearer.{key}"]) as ws:  # type: ignore[list-item]
            assert ws.response is not None and ws.subprotocol == "sluice.v1"
            return ws.response.headers["link"], await chat_over(ws, "old path")

    link, frames = asyncio.run(go())
    # then it is served, and told where the socket lives now
    assert "".join(f.get("delta", "") for f in frames) == "old path"
    assert link == f'<{CHAT_SOCKET_PATH}>; rel="successor-version"'


def test_the_openai_sdks_realtime_client_is_told_this_is_not_the_realtime_api(
        live: Live, key: str) -> None:
    # given the official SDK's Realtime client pointed at this server
    client = openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0)
    with client.realtime.connect(model="gpt-realtime") as connection:
        # when it reads the server's events
        event = connection.recv()
        # then the first is a Realtime error event saying so, naming our socket
        assert event.type == "error"
        assert "does not speak the OpenAI Realtime API" in event.error.message
        assert CHAT_SOCKET_PATH in event.error.message
        # and the socket is closed with a clear code and reason
        with pytest.raises(ConnectionClosed) as closed:
            connection.recv()
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == CLOSE_NOT_REALTIME
    assert "does not speak the OpenAI Realtime API" in closed.value.rcvd.reason
    assert CHAT_SOCKET_PATH in closed.value.rcvd.reason


@pytest.mark.parametrize("offer", [
    {"subprotocols": ["realtime", "openai-insecure-api-key.sk-test",
                      "openai-beta.realtime-v1"]},  # a browser (OpenAI's docs)
    {"additional_headers": {"OpenAI-Beta": "realtime=v1"}},  # the beta SDKs
])
def test_a_realtime_client_gets_the_close_reason_whatever_it_sends(
        live: Live, offer: dict[str, Any]) -> None:
    # given a Realtime client's handshake without our credentials
    async def go() -> tuple[str | None, int, str]:
        async with websockets.connect(ws_url(live, "/v1/realtime"), **offer) as ws:
            subprotocol = ws.subprotocol
            await asyncio.wait_for(ws.recv(), 20)  # its error event
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 20)
        assert closed.value.rcvd is not None
        return subprotocol, closed.value.rcvd.code, closed.value.rcvd.reason

    subprotocol, code, reason = asyncio.run(go())
    # then the handshake completes (a browser needs one of its offers answered, never
    # the key), and the close frame says why and where to go
    offered = offer.get("subprotocols")
    assert subprotocol == ("realtime" if offered else None)
    assert code == CLOSE_NOT_REALTIME
    assert reason.startswith("This server does not speak the OpenAI Realtime API")
    assert CHAT_SOCKET_PATH in reason
