"""Request body limits in front of Django, before anything reads a body.

Django's ASGI handler copies a request's whole body into a temporary file (on disk past
FILE_UPLOAD_MAX_MEMORY_SIZE) before any middleware or authentication runs, so a limit
checked inside Django comes too late: an anonymous client could make each worker write
gigabytes. `BodyLimit` wraps that handler:

- a declared `Content-Length` over the route's limit is answered 413 at once, the body
  never read;
- a body without one (chunked), or one longer than declared, is counted as it arrives:
  the message that passes the limit is not handed on, the client gets 413, and the
  application sees `http.disconnect` (Django then drops the request quietly);
- a malformed `Content-Length` is 400.

Refusals carry `Connection: close`, so the server stops reading the rest of the body
(a chunked body is read up to LINGER_BYTES past the limit first, and dropped).
The error is the API's JSON envelope (sluice.errors), the one shape that the management
API and Django's /v1 routes share; the lean /v1 inference routes are not behind this
guard, they read their own bodies against SLUICE_MAX_INFERENCE_BODY_BYTES in their
APIs' shapes (streaming/apis/httpio.py).

Limits (`route_limit`): the Files API upload (POST /v1/files) SLUICE_MAX_FILE_BYTES,
every other route DATA_UPLOAD_MAX_MEMORY_SIZE (SLUICE_MAX_BODY_BYTES).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from django.conf import settings

from sluice.errors import ApiError, BadRequest, PayloadTooLarge

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Any, Any], Awaitable[None]]  # Django types its receive/send loosely

UPLOAD_PATH = "/v1/files"
# Past the limit, this much more is read and dropped before the 413 (a lingering close,
# as nginx's): a client that sent its whole small body before reading gets the answer,
# where closing on unread bytes would reset the connection and lose it. Beyond this
# the rest is not read.
LINGER_BYTES = 1024 * 1024


def route_limit(path: str) -> int:
    """The most bytes a request body to `path` may have."""
    if path.rstrip("/") == UPLOAD_PATH:
        return int(settings.SLUICE_MAX_FILE_BYTES)
    return int(settings.DATA_UPLOAD_MAX_MEMORY_SIZE)


def declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The request's Content-Length, None when it has none; BadRequest when it is not
    one decimal number (several headers that differ count as malformed)."""
    values = {value.strip() for name, value in headers if name.lower() == b"content-length"}
    if not values:
        return None
    if len(values) > 1:
        raise BadRequest("Content-Length is given more than once.")
    (value,) = values
    if not value.isdigit() or len(value) > 19:  # 19 digits: any size a disk could hold
        raise BadRequest("Content-Length is not a number.")
    return int(value)


async def send_error(send: Send, exc: ApiError) -> None:
    """The error as a complete JSON response that closes the connection."""
    body = orjson.dumps(exc.body())
    await send({"type": "http.response.start", "status": exc.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware (HTTP only) refusing bodies over `limit(path)`: see the module's
    doc. Within the limit it adds one counter per body message and nothing else."""

    def __init__(self, app: App, limit: Callable[[str], int] = route_limit) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limit(scope["path"])
        try:
            declared = declared_length(scope.get("headers", []))
        except BadRequest as exc:
            await send_error(send, exc)
            return
        if declared is not None and declared > limit:
            await send_error(send, _too_large(limit, declared))
            return
        received = 0
        responded = False  # by the application, or by the refusal below
        refused = False

        async def counted_receive() -> Message:
            nonlocal received, responded, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] != "http.request":
                return message
            received += len(message.get("body", b""))
            if received <= limit:
                return message
            refused = True
            await _drain(receive, message)
            if not responded:
                responded = True
                await send_error(send, _too_large(limit))
            return {"type": "http.disconnect"}

        async def guarded_send(message: Message) -> None:
            nonlocal responded
            if refused:
                return  # the 413 is the response; the application's comes too late
            responded = True
            await send(message)

        await self.app(scope, counted_receive, guarded_send)


async def _drain(receive: Receive, message: Message) -> None:
    """Read and drop the body after `message`, up to LINGER_BYTES."""
    dropped = 0
    while message.get("more_body") and dropped < LINGER_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        dropped += len(message.get("body", b""))


def _too_large(limit: int, declared: int | None = None) -> PayloadTooLarge:
    if declared is None:
        return PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes.")
    return PayloadTooLarge(f"Request body is {declared} bytes; the limit is {limit} bytes.")
