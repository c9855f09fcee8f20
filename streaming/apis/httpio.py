"""The lean ASGI path's plumbing, shared by every API it serves: the ASGI types, reading
a request's JSON body (within the size and nesting limits), sending a JSON reply, and
an SSE stream's keep-alive."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from django.conf import settings

from sluice.errors import BadRequest, PayloadTooLarge
from streaming.pipeline.nesting import check_depth

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


class KeepAlive:
    """Sends a stream's chunks, and an SSE comment line whenever `interval` passes with
    nothing sent (proxies close a silent stream). One timer per stream, rearmed only
    when it fires: a chunk costs a time stamp, not a timeout of its own.

    A codec that makes several events of one worker event `add`s them and `flush`es
    once, so they leave in one write (a write is a system call: the Responses API's
    first and last token make four events each); what is still queued when the stream
    ends goes with its last message (`take`)."""

    def __init__(self, send: Send, interval: float) -> None:
        self._send, self._interval = send, interval
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._sending = False
        self._queued: list[bytes] = []
        self._beat: asyncio.Task[None] | None = None
        self._timer = self._loop.call_later(interval, self._due)

    async def send(self, body: bytes) -> None:
        if self._beat is not None:  # a keep-alive line is being sent: after it
            await asyncio.shield(self._beat)
        self._sending = True
        try:
            await self._send({"type": "http.response.body", "body": body, "more_body": True})
        finally:
            self._sending = False
            self._last = self._loop.time()

    def add(self, body: bytes) -> None:
        """Queue a chunk for the next `flush` (or `take`)."""
        self._queued.append(body)

    async def flush(self) -> None:
        """Send the queued chunks as one."""
        if self._queued:
            await self.send(self.take())

    def take(self) -> bytes:
        """The queued chunks, joined, no longer queued."""
        body = b"".join(self._queued)
        self._queued.clear()
        return body

    def _due(self) -> None:
        idle = self._loop.time() - self._last
        if idle < self._interval:
            self._timer = self._loop.call_later(self._interval - idle, self._due)
            return
        # Idle, unless a chunk is still being sent (a slow reader): no line then.
        if not self._sending and self._beat is None:
            self._beat = asyncio.create_task(self._keep_alive())
        self._timer = self._loop.call_later(self._interval, self._due)

    async def _keep_alive(self) -> None:
        try:
            # A failed line means the client left: the stream's own next send says so.
            with contextlib.suppress(Exception):
                await self._send({"type": "http.response.body",
                                  "body": b": keep-alive\n\n", "more_body": True})
        finally:
            self._last = self._loop.time()
            self._beat = None

    async def close(self) -> None:
        """Stop the keep-alive lines (before the stream's last message)."""
        self._timer.cancel()
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
