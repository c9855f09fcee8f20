"""OpenAI's Chat Completions, `POST /v1/chat/completions`: a codec over the gateway's
chat call, answered as one `chat.completion` or, with `stream: true`, as Server-Sent
Events of `chat.completion.chunk`s ending in `data: [DONE]`.

A stream can be resumed: `Last-Event-ID: <rid>:<seq>` (an event's own id), or
`last_offset` with the `conversation_id` whose latest stream it is, sends the rest of
the earlier stream from its stored events (nothing regenerated), to whoever may read
the original (streaming/pipeline/replay.py), audited as `chat.completions.resume`. A fresh call
names its conversation in the body or in `X-Sluice-Conversation-Id`; its reply joins
the conversation before the caller sees the end of it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError

from sluice.db import async_db
from sluice.errors import BadRequest, NotFound
from streaming.apis import Api, Context, bodies, chat_request, register, sse
from streaming.apis.httpio import Send, send_json
from streaming.pipeline import choices, replay
from streaming.pipeline.fold import Delta, Failure, Final, Fold
from streaming.pipeline.schemas import ChatCompletionRequest, ConversationId
from streaming.pipeline.submitted import Submitted
from tenants.conversations import conversation_get


class Chat(Api):
    path = "/v1/chat/completions"
    action = "chat.completions"
    params = chat_request.PARAMS

    async def serve(self, ctx: Context) -> None:
        req = chat_request.parsed(ctx.data)
        call, headers = ctx.call, ctx.headers
        gateway = call.gateway
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
            rid = await gateway.client.latest_stream(principal.tenant_slug, conversation)
            if rid is None:
                raise NotFound("That conversation has no resumable stream.",
                               code="stream_not_found", param="conversation_id")
            resume = (rid, req.last_offset)
        if req.stream and resume is not None:
            choices.check(req.n or 1, resume=True)
            rid, after = resume
            # From the first event: the ones the client has (seq <= after) are not sent
            # again, but its tool calls' pieces among them say what it already holds.
            events = await call.resume(rid, after, model=req.model,
                                       conversation=conversation)
            await _stream(ctx.send, Fold(events), [rid], req, replay=after)
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
            await gateway.client.remember_stream(principal.tenant_slug,
                                                 sub.conversation_id, sub.handle.rid)
        async with call.watching(ctx.receive, resumable=req.stream):
            if req.stream:
                await _stream(ctx.send, Fold(sub.events(), sub.n),
                              [h.rid for h in sub.handles], req, before_done=call.remember,
                              subs=[sub])
            else:
                body = await bodies.chat_completion(sub, req)
                # Stored before the caller sees the reply: its next turn must find it.
                await call.remember(body["choices"][0]["message"]["content"] or "")
                await send_json(ctx.send, 200, body, sub.headers)


async def _stream(send: Send, fold: Fold, rids: list[str], req: ChatCompletionRequest, *,
                  replay: int | None = None,
                  before_done: Callable[[str], Awaitable[None]] | None = None,
                  subs: Sequence[Submitted] = ()) -> None:
    """Send the call's pieces as SSE chunks, choice i's (`rids[i]`) with `index` i;
    every chunk's id is its own request's `<rid>:<seq>` (an event sent as several
    chunks, a delta's tool-call pieces, has it on its last). Tool calls stream as
    OpenAI's deltas (`bodies.ToolDeltas`). A `replay` (a resume after that seq) sends
    no start chunk and only the events after it. `before_done` gets the first choice's
    text before the final `[DONE]` (so a conversation's next turn can already see it).
    With include_usage, one usage chunk ends the stream: every choice's usage, summed."""
    base = {"id": f"chatcmpl-{rids[0]}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": req.model, "system_fingerprint": None}
    # A text delta is most of a stream: its chunk is the call's fixed part around the
    # encoded text, not a dict encoded afresh per token (one per choice).
    event_ids = [b"id: " + rid.encode() + b":" for rid in rids]
    head = orjson.dumps(base)[:-1] + b',"choices":[{"index":'
    text_heads = [head + b'%d,"delta":{"content":' % i for i in range(len(rids))]
    text_tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'

    def chunk(i: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish}]}

    parts: list[str] = []  # the first choice's text
    tools = [bodies.ToolDeltas() for _ in rids]
    async with fold, sse.opened(send, fold, subs=subs, request_id=rids[0]) as out:
        # A worker event's chunks are queued and leave in one write (the role chunk
        # with the first; the finish with the tool calls' rest; the usage with [DONE]).
        def emit(i: int, seq: int | str, payload: Any) -> None:
            out.add(b"%s%s\ndata: %s\n\n" % (event_ids[i], str(seq).encode(),
                                              orjson.dumps(payload)))

        if replay is None:
            for i in range(len(rids)):
                emit(i, "start", chunk(i, {"role": "assistant", "content": ""}))
        i = seq = 0
        async for piece in fold:
            i, seq = piece.i, piece.seq
            if isinstance(piece, Delta):
                if piece.tools is not None:
                    deltas = tools[i].pieces(piece.tools)
                    if deltas and (replay is None or seq > replay):
                        frames = [b"data: %s\n\n" % orjson.dumps(chunk(i, {"tool_calls": c}))
                                  for c in deltas]  # the event's id only after them all
                        out.add(b"".join(frames[:-1]) + b"%s%d\n%s" % (event_ids[i], seq,
                                                                       frames[-1]))
                if replay is not None and seq <= replay:
                    pass  # the resuming client has it
                elif req.logprobs:  # the slow path: a dict a chunk
                    if i == 0:
                        parts.append(piece.text)
                    if piece.text or piece.lp:
                        emit(i, seq, chunk(i, {"content": piece.text},
                                           logprobs=bodies.choice_logprobs(req, piece.lp or [])))
                elif piece.text:
                    if i == 0:
                        parts.append(piece.text)
                    out.add(b"".join((event_ids[i], b"%d" % seq, b"\ndata: ", text_heads[i],
                                      orjson.dumps(piece.text), text_tail)))
            elif isinstance(piece, Final):
                if rest := tools[i].rest(piece.event):
                    emit(i, seq, chunk(i, {"tool_calls": rest}))
                emit(i, seq, chunk(i, {}, bodies.finish_reason(piece.event)))
            elif isinstance(piece, Failure):
                emit(i, seq, piece.error.body())
            await out.flush()
        if req.stream_options is not None and req.stream_options.include_usage \
                and fold.done:
            counted = fold.usage()
            emit(i, seq, {**base, "choices": [], "usage": {
                **bodies.usage(counted), **bodies.cost(subs[0] if subs else None, counted)}})
    if before_done is not None:
        await before_done("".join(parts))
    await sse.last(send, out, b"data: [DONE]\n\n")


register(Chat())
