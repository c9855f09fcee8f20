"""The SSE baseline: the smallest ASGI app that streams chat-completion chunks the way a
batching model does. Every open stream gets its next token on one shared tick (every
BARE_SSE_TOKEN_MS, default 1000), as every sequence of a batch gets its token from one
decode step; `max_tokens` of the request body sets how many. What fanning a token out
to N streams costs the server and the client on this machine, with no Sluice at all."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from bare_asgi import read_body

TOKEN_S = float(os.environ.get("BARE_SSE_TOKEN_MS", "1000")) / 1000
CHUNK = (b'data: {"object":"chat.completion.chunk","choices":[{"index":0,'
         b'"delta":{"content":"s"}}]}\n\n')
HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

_tick: asyncio.Future[None] | None = None
_ticking: set[asyncio.Task[None]] = set()  # a reference keeps the ticker alive


async def _ticker() -> None:
    global _tick
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(TOKEN_S)
        tick, _tick = _tick, loop.create_future()
        if tick is not None:
            tick.set_result(None)


async def next_tick() -> None:
    global _tick
    if _tick is None:
        _tick = asyncio.get_running_loop().create_future()
        _ticking.add(asyncio.ensure_future(_ticker()))
    await asyncio.shield(_tick)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = await read_body(receive)
    try:
        tokens = int(json.loads(body or b"{}").get("max_tokens") or 1)
    except (ValueError, AttributeError):
        tokens = 1
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    for _ in range(tokens):
        await next_tick()
        await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
