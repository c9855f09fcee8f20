"""The WebSocket adapter: `/v1/realtime`, a chat socket over the one gateway pipeline.

Authenticated at connect: `Authorization: Bearer <key|JWT>` header, or (browsers cannot
set headers) the subprotocol `sluice.bearer.<key|JWT>`. A failed authentication closes
the socket with 4401 (4403 for a role that may not call models).

Frames are JSON objects. Client -> server:
    {"type": "chat.request", "id": "r1", "request": {<chat completion body>}}
    {"type": "embeddings.request", "id": "e1", "request": {<embeddings body>}}
    {"type": "cancel", "id": "r1"}
Server -> client:
    {"type": "chat.delta", "id": "r1", "delta": "..."}
    {"type": "chat.done", "id": "r1", "finish_reason": "...", "usage": {...},
     "tool_calls": [...]}                       (tool_calls only when there are some)
    {"type": "embeddings.result", "id": "e1", "body": {<OpenAI embeddings body>}}
    {"type": "error", "id": "r1" | null, "error": {<OpenAI error>}}
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
import time
from typing import Any

from channels.generic.websocket import AsyncWebsocketConsumer
from pydantic import ValidationError

from governance.observe import served
from sluice.errors import ApiError, BadRequest, PermissionDenied
from streaming import bodies
from streaming.gateway import Gateway, Submitted, error_from_event, shared_gateway
from streaming.schemas import ChatCompletionRequest, EmbeddingRequest, validation_error
from tenants.principal import Principal
from tenants.roles import Action

MAX_IN_FLIGHT = 16
MAX_FRAME_BYTES = 4 * 1024 * 1024
SUBPROTOCOL_PREFIX = "sluice.bearer."
CLOSE_UNAUTHENTICATED, CLOSE_FORBIDDEN, CLOSE_TRY_LATER = 4401, 4403, 1013


class RealtimeConsumer(AsyncWebsocketConsumer):
    gateway: Gateway
    principal: Principal | None

    async def connect(self) -> None:
        self.gateway = shared_gateway()
        self.principal = None
        self.tasks: dict[str, asyncio.Task[None]] = {}
        headers = {k.decode().lower(): v.decode("latin-1")
                   for k, v in self.scope.get("headers", [])}
        token, subprotocol = headers.get("authorization"), None
        for offered in self.scope.get("subprotocols", []):
            if offered.startswith(SUBPROTOCOL_PREFIX):
                token, subprotocol = f"Bearer {offered[len(SUBPROTOCOL_PREFIX):]}", offered
        await self.accept(subprotocol)
        try:
            principal = await self.gateway.authenticate(token)
        except ApiError as exc:
            await self._error(None, exc)
            await self.close(CLOSE_TRY_LATER if exc.status >= 500 else CLOSE_UNAUTHENTICATED)
            return
        if not principal.can(Action.MODEL_USE):
            await self._error(None, PermissionDenied(
                f"Your role ({principal.role}) may not call models."))
            await self.close(CLOSE_FORBIDDEN)
            return
        self.principal = principal

    async def disconnect(self, code: int) -> None:
        for task in list(getattr(self, "tasks", {}).values()):
            task.cancel()

    async def receive(self, text_data: str | None = None,
                      bytes_data: bytes | None = None) -> None:
        if self.principal is None:
            return
        raw = text_data if text_data is not None else (bytes_data or b"").decode(
            "utf-8", "replace")
        if len(raw) > MAX_FRAME_BYTES:
            await self._error(None, BadRequest("Frame too large.", code="frame_too_large"))
            return
        try:
            frame = json.loads(raw)
        except ValueError:
            await self._error(None, BadRequest("Frames must be JSON objects.",
                                               code="invalid_json"))
            return
        if not isinstance(frame, dict):
            await self._error(None, BadRequest("Frames must be JSON objects.",
                                               code="invalid_json"))
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
            rid, kind, request if isinstance(request, dict) else {},
            {"traceparent": parent} if isinstance(parent, str) else None))
        self.tasks[rid] = task

        def forget(_: asyncio.Task[None]) -> None:
            self.tasks.pop(rid, None)

        task.add_done_callback(forget)

    async def _observed(self, rid: str, kind: str, request: dict[str, Any],
                        headers: dict[str, str] | None) -> None:
        """One request frame as a served request (span, metrics, access log)."""
        assert self.principal is not None  # noqa: S101 - receive() checked
        with served("/v1/realtime", "websocket", method=kind, headers=headers) as scope:
            scope.tenant = self.principal.tenant_slug
            try:
                scope.status = await self._run(rid, kind, request)
            except asyncio.CancelledError:
                scope.status = 499
                raise

    async def _run(self, rid: str, kind: str, request: dict[str, Any]) -> int:
        """Serve one request frame; returns its HTTP-equivalent status."""
        assert self.principal is not None  # noqa: S101 - receive() checked
        began, sub = time.monotonic(), None
        action = "embeddings" if kind == "embeddings.request" else "chat.completions"
        try:
            try:
                if kind == "embeddings.request":
                    emb = EmbeddingRequest.model_validate(request)
                    sub = await self.gateway.embed(self.principal, emb, protocol="websocket")
                    await self._send(rid, "embeddings.result",
                                     body=await bodies.embeddings(sub, emb))
                    return 200
                req = ChatCompletionRequest.model_validate(request)
            except ValidationError as exc:
                raise validation_error(exc) from None
            sub = await self.gateway.chat(self.principal, req, protocol="websocket",
                                          stream=True)
            await self._stream(rid, sub)
            return 200
        except ApiError as exc:
            if sub is None:
                self.gateway.refused(self.principal, exc, action=action,
                                     model=str(request.get("model", "")),
                                     protocol="websocket", began=began)
            await self._error(rid, exc)
            return exc.status
        except asyncio.CancelledError:
            if sub is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(sub.handle.cancel())
            raise

    async def _stream(self, rid: str, sub: Submitted) -> None:
        parts: list[str] = []
        async for event in sub.events():
            if event["t"] == "delta" and (event["text"] or event.get("lp")):
                parts.append(event["text"])
                extra = {"logprobs": event["lp"]} if "lp" in event else {}
                await self._send(rid, "chat.delta", delta=event["text"], **extra)
            elif event["t"] == "error":
                raise error_from_event(event)
            elif event["t"] == "done":
                done: dict[str, Any] = {"finish_reason": bodies.finish_reason(event),
                                        "usage": bodies.usage(event)}
                if event.get("tool_calls"):
                    done["tool_calls"] = bodies.tool_calls(event["tool_calls"])
                await self.gateway.remember(sub, "".join(parts))
                await self._send(rid, "chat.done", **done)

    async def _send(self, rid: str | None, kind: str, **fields: Any) -> None:
        await self.send(text_data=json.dumps({"type": kind, "id": rid, **fields}))

    async def _error(self, rid: str | None, exc: ApiError) -> None:
        await self._send(rid, "error", error=exc.body()["error"])
