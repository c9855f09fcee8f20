"""The lean ASGI path's plumbing, shared by every API it serves: the ASGI types, reading
a request's JSON body (within the size and nesting limits), sending a JSON reply."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from django.conf import settings

from sluice.errors import BadRequest, PayloadTooLarge
from streaming.nesting import check_depth

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
_JSON = [(b"content-type", b"application/json")]


class ClientGone(Exception):
    pass


async def send_json(send: Send, status: int, body: Any,
                     headers: dict[str, str] | None = None) -> None:
    encoded = orjson.dumps(body)
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": [
        *_JSON, (b"content-length", b"%d" % len(encoded)), *raw]})
    await send({"type": "http.response.body", "body": encoded})


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes.")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def read_json(headers: dict[str, str], receive: Receive) -> dict[str, Any]:
    """The request's JSON object, within the body size limit and the nesting limit."""
    length = headers.get("content-length")
    limit = settings.SLUICE_MAX_INFERENCE_BODY_BYTES
    if length is not None and length.isascii() and length.isdigit() \
            and int(length) > limit:
        raise PayloadTooLarge(f"Request body is {length} bytes; the limit is {limit}.")
    raw = await read_body(receive, limit)
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest("We could not parse the JSON body of your request.",
                         code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequest("The request body must be a JSON object.", code="invalid_json")
    check_depth(data)
    return data
