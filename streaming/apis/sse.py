"""The start and end of a Server-Sent Events reply, for every API that streams (Chat
Completions, Completions, Responses, Anthropic Messages): the only writer of an event
stream's response headers.

    async with sse.opened(send, fold, subs=[sub]) as out:
        ...  # out.add(frame) / await out.flush() per worker event
    await sse.last(send, out, b"data: [DONE]\\n\\n")

`opened` waits for the call's first event (`Fold.start`): an error then is raised, so
that the caller answers it as a plain HTTP error in its API's shape; only then is the
200 sent (the event-stream headers; `x-request-id`, the `request_id` given or else the
first call's request id, as of the first event: a model alias's call may have moved
to its next deployment; the `headers` given, else the last call's own)
and the keep-alive armed (streaming/apis/httpio.py KeepAlive), which stops when the block
exits. `last` sends what is still queued and the API's own closing bytes as the
reply's last message; a stream that raised sends none (its server ends the reply).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from django.conf import settings

from streaming.apis.httpio import KeepAlive

if TYPE_CHECKING:
    from streaming.apis.httpio import Send
    from streaming.pipeline.fold import Fold
    from streaming.pipeline.submitted import Submitted

_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class opened:  # used as a function: `async with sse.opened(...)`
    """See the module's docstring. A class, not a generator's context manager: it runs
    for every streamed call."""

    __slots__ = ("_fold", "_headers", "_out", "_request_id", "_send", "_subs")

    def __init__(self, send: Send, fold: Fold, *, subs: Sequence[Submitted] = (),
                 request_id: str | None = None, headers: dict[str, str] | None = None
                 ) -> None:
        self._send, self._fold, self._subs = send, fold, subs
        self._request_id, self._headers = request_id, headers
        self._out: KeepAlive | None = None

    async def __aenter__(self) -> KeepAlive:
        await self._fold.start()
        subs, rid, headers = self._subs, self._request_id, self._headers
        if rid is None and subs:
            rid = subs[0].handle.rid
        own = [(b"x-request-id", rid.encode())] if rid is not None else []
        if headers is None:
            headers = subs[-1].headers if subs else {}
        await self._send({"type": "http.response.start", "status": 200, "headers": [
            *_HEADERS, *own,
            *((k.lower().encode(), v.encode()) for k, v in headers.items())]})
        self._out = KeepAlive(self._send, settings.SLUICE_SSE_HEARTBEAT_S)
        return self._out

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._out is not None:
            await self._out.close()


async def last(send: Send, out: KeepAlive, tail: bytes = b"") -> None:
    await send({"type": "http.response.body", "body": out.take() + tail,
                "more_body": False})
