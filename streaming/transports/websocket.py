"""The WebSocket adapter: `/v1/realtime`, a chat socket over the one gateway pipeline.

Authenticated at connect: `Authorization: Bearer <key|JWT>` header, or (browsers cannot
set headers) by offering the subprotocols `sluice.v1` and `sluice.bearer.<key|JWT>`. The
handshake answers `sluice.v1`, never the credential (RFC 6455 has the server answer one
of the offered values, so the offer carries a non-secret one); a client that offers only
`sluice.bearer.<...>` is signed in and gets no subprotocol back. A failed authentication
closes the socket with 4401 (4403 for a role that may not call models). Every request
frame authenticates the credential again (cached, as a REST call does), so a socket is
refused from the moment its key is revoked or its token expires: 4401 after the frame's
error.

A socket lives as long as its client keeps it: it holds no Redis read of its own (the
Channels layer carries nothing for it, so it is not subscribed there), and the HTTP
server pings idle sockets (uvicorn and daphne every 20 s; see sluice/servers.py).

Frames are JSON objects. Client -> server:
    {"type": "chat.request", "id": "r1", "request": {<chat completion body>}}
    {"type": "embeddings.request", "id": "e1", "request": {<embeddings body>}}
    {"type": "cancel", "id": "r1"}
Server -> client:
    {"type": "chat.delta", "id": "r1", "index": 0, "delta": "...",
     "tool_calls": [...]}          (tool_calls only on pieces of calls being written)
    {"type": "chat.done", "id": "r1", "index": 0, "finish_reason": "...", "usage": {...},
     "tool_calls": [...]}                       (tool_calls only when there are some)
`index` is the choice's; a request with `n` > 1 gets one chat.done per choice, and only
its last carries `usage` (every choice's, summed) and, when the deployment's policy
lowered the request's max_tokens, `max_tokens_clamped` (the value it ran with). A
chat.delta's `tool_calls` are OpenAI's stream deltas (streaming/apis/bodies.py's ToolDeltas:
a call's `index`, `id`, `type` and `function.name` first, then `function.arguments`
pieces by `index`, which join into its arguments); chat.done has every call whole, streamed or not.
    {"type": "embeddings.result", "id": "e1", "body": {<OpenAI embeddings body>}}
    {"type": "error", "id": "r1" | null, "error": {<OpenAI error>}}
Every bad frame gets an error frame and the socket stays open: one that is not a JSON
object, or nests deeper than MAX_JSON_DEPTH levels, gets a 400 (`invalid_json`,
`json_too_deep`) with the frame's id when it has one, else null. A request that fails
unexpectedly gets its own 500 (`server_error`) frame; a failure of the socket's own
handling is logged and closes it with 1011.
A request frame may carry `"traceparent": "<W3C traceparent>"` to join the caller's trace.
Several requests may run at once (ids keep them apart, up to MAX_IN_FLIGHT); a cancel
frame, or the socket closing, cancels the generation on the worker. When the platform
cannot authenticate at all (a 5xx: its database or Redis is down), the socket closes
with 1013 (try again later); per-request overload (breakers, shedding, quotas) comes
back as that request's error frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import orjson
from channels.generic.websocket import AsyncWebsocketConsumer
from redis.exceptions import RedisError

from sluice.errors import ApiError, BadRequest, PermissionDenied, ServerError
from sluice.observability.observe import served
from streaming.apis import bodies, chat_request
from streaming.pipeline.call import Call
from streaming.pipeline.callrequest import CallRequest
from streaming.pipeline.failures import queue_unavailable
from streaming.pipeline.fold import Delta, Failure, Final, Fold
from streaming.pipeline.gateway import Gateway, shared_gateway
from streaming.pipeline.max_tokens_policy import CLAMPED_HEADER
from streaming.pipeline.nesting import MAX_JSON_DEPTH, check_depth
from streaming.pipeline.schemas import EmbeddingRequest, parse
from tenants.principal import Principal
from tenants.roles import Action
from tenants.throttle import asgi_source

logger = logging.getLogger("sluice.streaming")

MAX_IN_FLIGHT = 16
MAX_FRAME_BYTES = 4 * 1024 * 1024
SUBPROTOCOL = "sluice.v1"
SUBPROTOCOL_PREFIX = "sluice.bearer."
CLOSE_UNAUTHENTICATED, CLOSE_FORBIDDEN, CLOSE_TRY_LATER = 4401, 4403, 1013
CLOSE_INTERNAL_ERROR = 1011


class RealtimeConsumer(AsyncWebsocketConsumer):
    gateway: Gateway
    principal: Principal | None
    # Not subscribed to the Channels layer: nothing reaches these sockets through it,
    # and its blocking Redis read would tie every socket's life to Redis's (a failed
    # read ends the consumer). An alias that is not configured means no layer.
    channel_layer_alias = "sluice.realtime.unsubscribed"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Channels' dispatch loop; an error it did not expect is logged and closes the
        socket with 1011, where the server would drop it without a close frame."""
        try:
            await super().__call__(scope, receive, send)
        except Exception:
            logger.exception("websocket /v1/realtime failed; closing it with 1011")
            await self.disconnect(CLOSE_INTERNAL_ERROR)
            with contextlib.suppress(Exception):  # the client may be gone already
                await send({"type": "websocket.close", "code": CLOSE_INTERNAL_ERROR})

    async def connect(self) -> None:
        self.gateway = shared_gateway()
        self.principal = None
        self.tasks: dict[str, asyncio.Task[None]] = {}
        headers = {k.decode().lower(): v.decode("latin-1")
                   for k, v in self.scope.get("headers", [])}
        offered = list(self.scope.get("subprotocols", []))
        self.authorization = headers.get("authorization")
        self.source = asgi_source(self.scope, headers)  # where wrong keys count
        for protocol in offered:
            if protocol.startswith(SUBPROTOCOL_PREFIX):
                self.authorization = f"Bearer {protocol[len(SUBPROTOCOL_PREFIX):]}"
        await self.accept(SUBPROTOCOL if SUBPROTOCOL in offered else None)
        try:
            self.principal = await self._signed_in()
        except ApiError as exc:
            await self._refuse(None, exc)

    async def disconnect(self, code: int) -> None:
        for task in list(getattr(self, "tasks", {}).values()):
            task.cancel()

    async def receive(self, text_data: str | None = None,
                      bytes_data: bytes | None = None) -> None:
        if self.principal is None:
            return
        raw = text_data if text_data is not None else bytes_data or b""
        if len(raw) > MAX_FRAME_BYTES:
            await self._error(None, BadRequest("Frame too large.", code="frame_too_large"))
            return
        try:
            # orjson, not json: it refuses nesting past 1,024 levels with an error,
            # where json recurses into a RecursionError.
            frame = orjson.loads(raw)
        except orjson.JSONDecodeError:
            frame = None
        if not isinstance(frame, dict):
            await self._error(None, BadRequest("Frames must be JSON objects.",
                                               code="invalid_json"))
            return
        try:
            # The frame wraps a request body in one level more than REST's.
            check_depth(frame, what="The frame", limit=MAX_JSON_DEPTH + 1)
        except BadRequest as exc:
            rid = frame.get("id")
            await self._error(rid if isinstance(rid, str) and 0 < len(rid) <= 64
                              else None, exc)
            return
        rid, kind = frame.get("id"), frame.get("type")
        if not isinstance(rid, str) or not 0 < len(rid) <= 64:
            await self._error(None, BadRequest("Every frame needs an id (1-64 characters).",
                                               param="id"))
            return
        if kind == "cancel":
            task = self.tasks.get(rid)
            if task is not None:
                task.cancel()
            return
        if kind not in ("chat.request", "embeddings.request"):
            await self._error(rid, BadRequest(f"Unknown frame type: {str(kind)[:40]}.",
                                              param="type"))
            return
        if rid in self.tasks:
            await self._error(rid, BadRequest("A request with this id is running.",
                                              param="id"))
            return
        if len(self.tasks) >= MAX_IN_FLIGHT:
            await self._error(rid, BadRequest(
                f"At most {MAX_IN_FLIGHT} requests at once per socket.",
                code="too_many_in_flight"))
            return
        request = frame.get("request")
        parent = frame.get("traceparent")
        task = asyncio.create_task(self._observed(
            self.principal, rid, kind, request if isinstance(request, dict) else {},
            {"traceparent": parent} if isinstance(parent, str) else None))
        self.tasks[rid] = task

        def forget(_: asyncio.Task[None]) -> None:
            self.tasks.pop(rid, None)

        task.add_done_callback(forget)

    async def _observed(self, principal: Principal, rid: str, kind: str,
                        request: dict[str, Any], headers: dict[str, str] | None) -> None:
        """One request frame as a served request (span, metrics, access log)."""
        with served("/v1/realtime", "websocket", method=kind, headers=headers) as scope:
            scope.tenant = principal.tenant_slug
            try:
                scope.status = await self._run(principal, rid, kind, request)
            except asyncio.CancelledError:
                scope.status = 499
                raise

    async def _run(self, principal: Principal, rid: str, kind: str,
                   request: dict[str, Any]) -> int:
        """Serve one request frame; returns its HTTP-equivalent status."""
        action = "embeddings" if kind == "embeddings.request" else "chat.completions"
        try:
            try:
                principal = await self._signed_in()
            except ApiError as exc:
                if exc.status >= 500:
                    raise  # the platform failed: this request fails, the socket stays
                self.principal = None  # frames still buffered are ignored
                await self._refuse(rid, exc)
                return exc.status
            async with Call(self.gateway, principal, action=action,
                            protocol="websocket", params=chat_request.PARAMS) as call:
                call.model = str(request.get("model", ""))[:100]
                if kind == "embeddings.request":
                    emb = parse(EmbeddingRequest, request)
                    sub = await call.embed(emb)
                    await self._send(rid, "embeddings.result",
                                     body=await bodies.embeddings(sub, emb))
                else:
                    await self._stream(rid, call, chat_request.call_request(
                        chat_request.parsed(request), stream=True))
            return 200
        except ApiError as exc:
            await self._error(rid, exc)
            return exc.status
        except RedisError:  # under the sign-in: retriable, as on REST
            await self._error(rid, queue_unavailable())
            return 503
        except Exception:
            logger.exception("websocket request %s failed", kind)
            await self._error(rid, ServerError(
                "The server had an error processing your request."))
            return 500

    async def _signed_in(self) -> Principal:
        """The socket's credential as a REST call would find it now (the cached path):
        raises Unauthenticated for one revoked, expired or demoted since the socket
        opened, PermissionDenied for a role that may not call models."""
        principal = await self.gateway.authenticate(self.authorization, source=self.source)
        if not principal.can(Action.MODEL_USE):
            raise PermissionDenied(f"Your role ({principal.role}) may not call models.")
        return principal

    async def _stream(self, rid: str, call: Call, req: CallRequest) -> None:
        """The call's frames, each with its choice's `index`. A call's last `chat.done`
        carries its usage (with n > 1, every choice's summed; the others carry none)."""
        sub = await call.chat(req)
        parts: list[str] = []  # the first choice's text, for its conversation
        tools = [bodies.ToolDeltas() for _ in range(sub.n)]
        async with Fold(sub.events(), sub.n) as fold:
            async for piece in fold:
                if isinstance(piece, Delta):
                    extra: dict[str, Any] = {"logprobs": piece.lp} if piece.lp is not None \
                        else {}
                    if piece.tools is not None:
                        if calls := [c for cs in tools[piece.i].pieces(piece.tools)
                                     for c in cs]:
                            extra["tool_calls"] = calls
                        elif not (piece.text or piece.lp):
                            continue
                    if piece.i == 0:
                        parts.append(piece.text)
                    await self._send(rid, "chat.delta", index=piece.i, delta=piece.text,
                                     **extra)
                elif isinstance(piece, Failure):
                    raise piece.error  # with n > 1, the other choices are cancelled now
                elif isinstance(piece, Final):
                    final = piece.event
                    done: dict[str, Any] = {"index": piece.i,
                                            "finish_reason": bodies.finish_reason(final)}
                    if final.get("tool_calls"):
                        done["tool_calls"] = bodies.tool_calls(final["tool_calls"])
                    if len(fold.finals) == sub.n:  # the call's last frame
                        done["usage"] = bodies.usage(fold.usage())
                        if CLAMPED_HEADER in sub.headers:
                            done["max_tokens_clamped"] = int(sub.headers[CLAMPED_HEADER])
                        await call.remember("".join(parts))
                    await self._send(rid, "chat.done", **done)

    async def _send(self, rid: str | None, kind: str, **fields: Any) -> None:
        await self.send(text_data=json.dumps({"type": kind, "id": rid, **fields}))

    async def _error(self, rid: str | None, exc: ApiError) -> None:
        await self._send(rid, "error", error=exc.body()["error"])

    async def _refuse(self, rid: str | None, exc: ApiError) -> None:
        """The error frame, then the close code for it: 1013 when the platform could not
        authenticate at all, 4403 for a principal that may not call models, else 4401."""
        await self._error(rid, exc)
        await self.close(CLOSE_TRY_LATER if exc.status >= 500 else
                         CLOSE_FORBIDDEN if isinstance(exc, PermissionDenied) else
                         CLOSE_UNAUTHENTICATED)
