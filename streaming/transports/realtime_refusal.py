"""`/v1/realtime`: OpenAI's Realtime API path, which this server does not speak.

Our own chat socket is `CHAT_SOCKET_PATH` (streaming/transports/websocket.py). It was first
mounted at `/v1/realtime`, where an OpenAI Realtime client (its SDKs, a browser using
its subprotocols) then met a protocol it does not know and failed obscurely. On that
path now:

- an OpenAI Realtime client, told apart by what it sends and ours never does (the
  `OpenAI-Beta: realtime=v1` header, a `model` query parameter, the subprotocol
  `realtime` or one named `openai-...`), is accepted (with the `realtime` subprotocol
  when it offered it: a browser fails a handshake that answers none of its offers),
  sent one Realtime `error` event and closed with CLOSE_NOT_REALTIME and a reason that
  names our socket's path. It is not authenticated: nothing of the platform is used;
- any other client is our own, served by the chat socket as before (deprecated: the
  handshake answers a `Link` header to CHAT_SOCKET_PATH, rel="successor-version").
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

import orjson

from streaming.apis.httpio import Receive, Scope, Send

CHAT_SOCKET_PATH = "/v1/chat/socket"
CLOSE_NOT_REALTIME = 4400  # 4000-4999: the application's; 4400 reads as "bad request"
# A close frame's reason is at most 123 bytes of UTF-8 (RFC 6455, 5.5.1).
REASON = (f"This server does not speak the OpenAI Realtime API; its chat socket is "
          f"{CHAT_SOCKET_PATH}")
_SUCCESSOR = (b"link", f'<{CHAT_SOCKET_PATH}>; rel="successor-version"'.encode())


def speaks_openai_realtime(scope: Scope) -> bool:
    """Whether a WebSocket handshake is an OpenAI Realtime client's."""
    offered = scope.get("subprotocols") or []
    beta = b",".join(v for k, v in scope.get("headers", []) if k.lower() == b"openai-beta")
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return (b"realtime" in beta.lower() or "model" in query
            or any(p == "realtime" or p.startswith("openai-") for p in offered))


async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
    """Accept, send one Realtime `error` event, close with the reason."""
    if (await receive())["type"] != "websocket.connect":
        return
    offered = scope.get("subprotocols") or []
    await send({"type": "websocket.accept",
                "subprotocol": "realtime" if "realtime" in offered else None})
    await send({"type": "websocket.send", "text": orjson.dumps({
        "type": "error", "event_id": "event_sluice_not_realtime",
        "error": {"type": "invalid_request_error", "code": "unsupported_protocol",
                  "message": f"{REASON} (docs/PROTOCOLS.md).", "param": None,
                  "event_id": None}}).decode()})
    await send({"type": "websocket.close", "code": CLOSE_NOT_REALTIME, "reason": REASON})


class OpenAIRealtimePath:
    """The ASGI app of `/v1/realtime`: refuses an OpenAI Realtime client, hands any
    other to `chat_socket` (our socket's app), marked as moved."""

    def __init__(self, chat_socket: Any) -> None:
        self.chat_socket = chat_socket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if speaks_openai_realtime(scope):
            await refuse(scope, receive, send)
            return

        async def moved(message: dict[str, Any]) -> None:
            if message["type"] == "websocket.accept":
                message = {**message, "headers": [*message.get("headers", ()), _SUCCESSOR]}
            await send(message)

        await self.chat_socket(scope, receive, moved)
