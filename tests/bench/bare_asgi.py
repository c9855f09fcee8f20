"""The baseline: the smallest ASGI app that answers JSON (what a request costs with no
application at all, under the same server and worker count)."""

from __future__ import annotations

from typing import Any

BODY = b'{"ok": true}'


async def read_body(receive: Any) -> bytes:
    """A request's whole body (the baseline apps' one helper)."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": BODY})
