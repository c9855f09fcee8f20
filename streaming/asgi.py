"""The lean /v1 inference path: a plain ASGI app beside Django, no Django request cycle.

It serves POST /v1/chat/completions (JSON, or Server-Sent Events with `stream: true`)
and POST /v1/embeddings in OpenAI's shapes. Everything else goes to Django. The adapter
only parses, calls the gateway pipeline and encodes; errors are OpenAI-shaped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from django.conf import settings
from pydantic import TypeAdapter, ValidationError
from redis.exceptions import RedisError

from governance.observe import served
from inference.jobs import FINAL_EVENTS, Event, FinalEvent
from sluice.db import async_db
from sluice.errors import ApiError, BadRequest, NotFound, ServerError
from sluice.telemetry import RequestScope
from streaming import apis, bodies, choices, replay
from streaming.apis import chat_request
from streaming.call import Call
from streaming.gateway import error_from_event, queue_unavailable, shared_gateway
from streaming.httpio import ClientGone, KeepAlive, Receive, Scope, Send, read_json
from streaming.httpio import send_json as _send_json
from streaming.schemas import ChatCompletionRequest, ConversationId, EmbeddingRequest, parse
from tenants.conversations import conversation_get
from tenants.principal import Principal
from tenants.throttle import asgi_source

logger = logging.getLogger("sluice.streaming")


class LeanApp:
    ROUTES = {"/v1/chat/completions", "/v1/embeddings", *apis.APIS}

    def __init__(self) -> None:
        self.gateway = shared_gateway()

    def handles(self, path: str) -> bool:
        return path.rstrip("/") in self.ROUTES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in scope["headers"]}
        with served(scope["path"].rstrip("/"), "rest", method=scope["method"],
                    headers=headers) as observed:
            await self._serve(scope, headers, receive, send, observed)

    async def _serve(self, scope: Scope, headers: dict[str, str], receive: Receive,
                     send: Send, observed: RequestScope) -> None:
        started = False
        api = apis.APIS.get(scope["path"].rstrip("/"))

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if not started:
                observed.status = message.get("status", 200)
            started = True
            await send(message)

        try:
            await self._dispatch(scope, headers, receive, tracked_send, api)
        except ClientGone:
            observed.status = observed.status or 499
        except (ApiError, RedisError) as caught:
            # Redis failing under a call (a restart, a failover) is retriable, not a 500.
            exc = queue_unavailable() if isinstance(caught, RedisError) else caught
            if not started:
                status, body, extra = api.error(exc) if api else (exc.status, exc.body(),
                                                                  exc.headers)
                await _send_json(tracked_send, status, body, extra)
        except Exception:
            logger.exception("unhandled error on %s", scope.get("path"))
            if not started:
                error = ServerError("The server had an error processing your request.")
                status, body, extra = api.error(error) if api else (error.status,
                                                                    error.body(), None)
                await _send_json(tracked_send, status, body, extra)

    async def _dispatch(self, scope: Scope, headers: dict[str, str], receive: Receive,
                        send: Send, api: apis.Api | None) -> None:
        path = scope["path"].rstrip("/")
        if scope["method"] != "POST":
            raise BadRequest(f"{scope['method']} is not allowed on {path}; use POST.",
                             code="method_not_allowed")
        credential = api.credential(headers) if api else headers.get("authorization")
        principal = await self.gateway.authenticate(credential,
                                                    source=asgi_source(scope, headers))
        action = api.action if api else (
            "embeddings" if path == "/v1/embeddings" else "chat.completions")
        async with Call(self.gateway, principal, action=action, protocol="rest",
                        params=api.params if api else chat_request.PARAMS) as call:
            data = await read_json(headers, receive)
            if api is not None:
                await api.serve(apis.Context(self, call, data, headers, receive, send))
            elif path == "/v1/embeddings":
                emb = parse(EmbeddingRequest, data)
                sub = await call.embed(emb)
                await _send_json(send, 200, await bodies.embeddings(sub, emb), sub.headers)
            else:
                await self._chat(call, chat_request.parsed(data), headers, receive, send)

    async def _chat(self, call: Call, req: ChatCompletionRequest, headers: dict[str, str],
                    receive: Receive, send: Send) -> None:
        call.model = req.model
        call.protocol = "sse" if req.stream else "rest"
        principal = call.principal
        resume = replay.parse_event_id(headers.get("last-event-id"))
        conversation = None
        if req.last_offset is not None:
            if not (req.stream and req.conversation_id):
                raise BadRequest("last_offset needs stream: true and a conversation_id.",
                                 param="last_offset")
            conversation = req.conversation_id
            await async_db(conversation_get)(actor=principal, public_id=conversation)
            rid = await self.gateway.client.latest_stream(principal.tenant_slug, conversation)
            if rid is None:
                raise NotFound("That conversation has no resumable stream.",
                               code="stream_not_found", param="conversation_id")
            resume = (rid, req.last_offset)
        if req.stream and resume is not None:
            choices.check(req.n or 1, resume=True)
            call.action = "chat.completions.resume"
            await self._resume(principal, resume, req, send, conversation=conversation,
                               began=call.began)
            return
        header_conversation = headers.get("x-sluice-conversation-id")
        if header_conversation is not None and req.conversation_id is None:
            try:
                header_conversation = TypeAdapter(ConversationId).validate_python(
                    header_conversation)
            except ValidationError:
                raise BadRequest("X-Sluice-Conversation-Id is not a conversation id.",
                                 param="conversation_id") from None
        sub = await call.chat(chat_request.call_request(
            req, conversation_id=header_conversation,
            idempotency_key=headers.get("idempotency-key")))
        if req.stream and sub.conversation_id is not None:
            await self.gateway.client.remember_stream(principal.tenant_slug,
                                                      sub.conversation_id, sub.handle.rid)
        async with call.watching(receive, resumable=req.stream):
            if req.stream:
                await self._stream([h.rid for h in sub.handles], sub.events(), req, send,
                                   before_done=call.remember, headers=sub.headers)
            else:
                body = await bodies.chat_completion(sub, req)
                # Stored before the caller sees the reply: its next turn must find it.
                await call.remember(body["choices"][0]["message"]["content"] or "")
                await _send_json(send, 200, body, sub.headers)

    async def _resume(self, principal: Principal, resume: tuple[str, int],
                      req: ChatCompletionRequest, send: Send, *, conversation: str | None,
                      began: float) -> None:
        """The rest of an earlier stream, from its stored events: nothing regenerated.
        Only for whoever may read the original (streaming/replay.py); audited."""
        rid, after = resume
        tenant, client = principal.tenant_slug, self.gateway.client
        await replay.authorize_resume(principal, await client.owner_of(tenant, rid),
                                      model=req.model, conversation=conversation)
        if not await client.attach(tenant, rid):
            raise NotFound("No resumable stream with that Last-Event-ID.",
                           code="stream_not_found")
        self.gateway.governor.recorder.audit(replay.resume_event(
            principal, rid, model=req.model, after=after, protocol="sse", began=began))
        # From the first event: the ones the client has (seq <= after) are not sent
        # again, but its tool calls' pieces among them say what it already holds.
        events = client.replay(tenant, rid, timeout_s=settings.SLUICE_REQUEST_TIMEOUT_S)
        await self._stream([rid], events, req, send, replay=after)

    async def _stream(self, rids: list[str], events: AsyncIterator[Event],
                      req: ChatCompletionRequest, send: Send, *, replay: int | None = None,
                      before_done: Callable[[str], Awaitable[None]] | None = None,
                      headers: dict[str, str] | None = None) -> None:
        """Send the events as SSE chunks, choice i's (`rids[i]`) with `index` i; every
        event's id is its own request's `<rid>:<seq>` (an event sent as several chunks,
        a delta's tool-call pieces, has it on its last). Tool calls stream as OpenAI's
        deltas (`bodies.ToolDeltas`). A `replay` (a resume after that seq) sends no
        start chunk and only the events after it. `before_done` gets the first choice's
        text before the final `[DONE]` (so a conversation's next turn can already see
        it). With include_usage, one usage chunk ends the stream: every choice's usage,
        summed."""
        base = {"id": f"chatcmpl-{rids[0]}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": req.model, "system_fingerprint": None}
        first = await anext(events)  # errors before any output are still plain HTTP errors
        if first["t"] == "error":
            raise error_from_event(first)
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
            (b"x-request-id", rids[0].encode()),
            *((k.encode(), v.encode()) for k, v in (headers or {}).items())]})
        out = KeepAlive(send, settings.SLUICE_SSE_HEARTBEAT_S)
        # A text delta is most of a stream: its chunk is the call's fixed part around
        # the encoded text, not a dict encoded afresh per token (one per choice).
        event_ids = [b"id: " + rid.encode() + b":" for rid in rids]
        head = orjson.dumps(base)[:-1] + b',"choices":[{"index":'
        text_heads = [head + b'%d,"delta":{"content":' % i for i in range(len(rids))]
        text_tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'

        # A worker event's chunks are queued and leave in one write (the role chunk
        # with the first; the finish with the tool calls' rest; the usage with [DONE]).
        def emit(i: int, seq: int | str, payload: Any) -> None:
            out.add(b"%s%s\ndata: %s\n\n" % (event_ids[i], str(seq).encode(),
                                              orjson.dumps(payload)))

        def emit_tools(i: int, seq: int, deltas: list[list[dict[str, Any]]]) -> None:
            if deltas:  # the event's id only after all its chunks
                frames = [b"data: %s\n\n" % orjson.dumps(chunk(i, {"tool_calls": calls}))
                          for calls in deltas]
                out.add(b"".join(frames[:-1]) + b"%s%d\n%s" % (event_ids[i], seq,
                                                               frames[-1]))

        def chunk(i: int, delta: dict[str, Any], finish: str | None = None,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
            return {**base, "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish}]}

        parts: list[str] = []  # the first choice's text
        finals: list[FinalEvent] = []
        tools = [bodies.ToolDeltas() for _ in rids]
        several = len(rids) > 1  # events carry their choice's index only then
        try:
            if replay is None:
                for i in range(len(rids)):
                    emit(i, "start", chunk(i, {"role": "assistant", "content": ""}))
            event: Event | None = first
            last: Event = first
            while event is not None:
                i = event["i"] if several else 0
                if event["t"] == "delta" and "tools" in event:
                    deltas = tools[i].pieces(event["tools"])
                    if replay is None or event["seq"] > replay:
                        emit_tools(i, event["seq"], deltas)
                if replay is not None and event["seq"] <= replay \
                        and event["t"] not in FINAL_EVENTS:
                    pass  # the resuming client has it
                elif event["t"] == "delta" and req.logprobs:  # the slow path: a dict a chunk
                    if i == 0:
                        parts.append(event["text"])
                    if event["text"] or event.get("lp"):
                        emit(i, event["seq"], chunk(
                            i, {"content": event["text"]},
                            logprobs=bodies.choice_logprobs(req, event.get("lp") or [])))
                elif event["t"] == "delta" and event["text"]:
                    if i == 0:
                        parts.append(event["text"])
                    out.add(b"".join((event_ids[i], b"%d" % event["seq"], b"\ndata: ",
                                      text_heads[i], orjson.dumps(event["text"]),
                                      text_tail)))
                elif event["t"] == "error":
                    finals.append(event)
                    emit(i, event["seq"], error_from_event(event).body())
                elif event["t"] == "done":
                    finals.append(event)
                    if rest := tools[i].rest(event):
                        emit(i, event["seq"], chunk(i, {"tool_calls": rest}))
                    emit(i, event["seq"], chunk(i, {}, bodies.finish_reason(event)))
                await out.flush()
                last = event
                event = await anext(events, None)
            if req.stream_options is not None and req.stream_options.include_usage \
                    and any(f["t"] == "done" for f in finals):
                emit(last.get("i", 0), last["seq"],
                     {**base, "choices": [], "usage": bodies.usage(*finals)})
        finally:
            await out.close()
        if before_done is not None:
            await before_done("".join(parts))
        await send({"type": "http.response.body", "body": out.take() + b"data: [DONE]\n\n",
                    "more_body": False})
