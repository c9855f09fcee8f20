"""OpenAI response bodies built from a call's events: written once, for the REST
adapter and the Batch API alike."""

from __future__ import annotations

import base64
import contextlib
import struct
import time
from typing import Any

from inference.jobs import DoneEvent, FinalEvent, ToolCall, ToolDelta
from sluice.errors import ServerError
from streaming.callrequest import CallRequest
from streaming.gateway import error_from_event
from streaming.schemas import ChatCompletionRequest, EmbeddingRequest
from streaming.submitted import Submitted, cancelled_error


def finish_reason(final: DoneEvent) -> str | None:
    """OpenAI's finish_reason of a choice's final event; None for a cancelled request
    (its reply is cut: never reported as finished, "stop"). A reply in one piece is
    never made of one (`all_done`)."""
    if final["finish"] == "cancelled":
        return None
    return {"length": "length", "tool_calls": "tool_calls"}.get(final["finish"], "stop")


def tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


class ToolDeltas:
    """One choice's tool calls as Chat Completions stream deltas (OpenAI's shape): a
    call's first chunk has its `index`, `id`, `type` and `function.name` with empty
    `arguments`, then one chunk per piece of its arguments (`index` and
    `function.arguments` only), as the worker streams them (`DeltaEvent.tools`).
    `pieces` gives the `delta.tool_calls` of each chunk for a delta event's pieces;
    `rest` what the final event adds, so that each call's joined arguments equal the
    final's exactly: a streamed call's missing tail, and every call the worker did not
    stream (an upstream deployment's come only with the final event) whole."""

    def __init__(self) -> None:
        self.sent: list[str] = []  # each streamed call's arguments so far, by index

    def pieces(self, pieces: list[ToolDelta]) -> list[list[dict[str, Any]]]:
        chunks: list[list[dict[str, Any]]] = []
        for piece in pieces:
            k = piece["index"]
            if "name" in piece and k == len(self.sent):
                self.sent.append("")
                chunks.append([{"index": k, "id": piece.get("id", ""), "type": "function",
                                "function": {"name": piece["name"], "arguments": ""}}])
            if piece["arguments"] and k < len(self.sent):
                self.sent[k] += piece["arguments"]
                chunks.append([{"index": k, "function": {"arguments": piece["arguments"]}}])
        return chunks

    def rest(self, final: DoneEvent) -> list[dict[str, Any]]:
        """The final chunk's `delta.tool_calls` (empty when nothing is missing)."""
        out: list[dict[str, Any]] = []
        for k, call in enumerate(tool_calls(final.get("tool_calls") or [])):
            if k >= len(self.sent):
                out.append({"index": k, **call})
                continue
            whole, sent = call["function"]["arguments"], self.sent[k]
            if len(whole) > len(sent) and whole.startswith(sent):
                out.append({"index": k, "function": {"arguments": whole[len(sent):]}})
        return out


def choice_logprobs(req: ChatCompletionRequest | CallRequest,
                    content: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A choice's (or a chunk's) `logprobs`: the tokens' entries, when asked for."""
    return {"content": content, "refusal": None} if req.logprobs else None


def usage(*finals: FinalEvent) -> dict[str, int]:
    """OpenAI's `usage` of final events: one call's, or its choices' summed."""
    prompt = completion = 0
    for final in finals:
        prompt += final["usage"]["prompt_tokens"]
        completion += final["usage"]["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def message(text: str, final: DoneEvent) -> dict[str, Any]:
    """A choice's assistant message: its tool calls when it made some, else its text."""
    if final.get("tool_calls"):
        return {"role": "assistant", "content": None,
                "tool_calls": tool_calls(final["tool_calls"])}
    return {"role": "assistant", "content": text}


async def whole_reply(sub: Submitted) -> tuple[str, DoneEvent]:
    """A one-choice call's whole text and its final event; a worker error raises its
    ApiError (the codecs that answer in one piece share this). The events are read to
    their end: leaving them at the final event would settle the call as one its
    consumer left (Submitted.events)."""
    parts: list[str] = []
    final: FinalEvent | None = None
    async with contextlib.aclosing(sub.events()) as events:
        async for event in events:
            if event["t"] == "delta":
                parts.append(event["text"])
            elif event["t"] == "done" or event["t"] == "error":
                final = event
    if final is None:
        raise ServerError("The call ended without a final event.")
    if final["t"] == "error":
        raise error_from_event(final)
    return "".join(parts), whole(final)


async def chat_completion(sub: Submitted, req: ChatCompletionRequest | CallRequest
                          ) -> dict[str, Any]:
    """A `chat.completion` from the call's events, one choice per sequence (`sub.n`);
    a worker error (of any choice) raises its ApiError."""
    # Plain loops, not comprehensions: this runs for every call, nearly all of them n = 1.
    parts: list[list[str]] = []
    logprobs: list[list[dict[str, Any]]] = []
    finals: list[DoneEvent | None] = []
    for _ in sub.handles:
        parts.append([])
        logprobs.append([])
        finals.append(None)
    events = sub.events()
    async for event in events:
        if event["t"] == "delta":
            i = event.get("i", 0)
            parts[i].append(event["text"])
            logprobs[i] += event.get("lp") or ()
        elif event["t"] == "error":
            await events.aclose()  # with n > 1, the other choices are cancelled now
            raise error_from_event(event)
        elif event["t"] == "done":
            finals[event.get("i", 0)] = event
    done = all_done(finals)
    choices = []
    for i, final in enumerate(done):
        choices.append({"index": i, "message": message("".join(parts[i]), final),
                        "finish_reason": finish_reason(final),
                        "logprobs": choice_logprobs(req, logprobs[i])})
    body: dict[str, Any] = {
        "id": f"chatcmpl-{sub.handle.rid}", "object": "chat.completion",
        "created": int(time.time()), "model": req.model, "system_fingerprint": None,
        "choices": choices, "usage": usage(*done),
    }
    if sub.conversation_id is not None:
        body["conversation_id"] = sub.conversation_id
    return body


def all_done(finals: list[DoneEvent | None]) -> list[DoneEvent]:
    """Every choice's final event (each choice ends with one, or the call raised), each
    `whole`."""
    done = [whole(final) for final in finals if final is not None]
    if len(done) != len(finals):
        raise ServerError("A choice ended without a final event.")
    return done


def whole(final: DoneEvent) -> DoneEvent:
    """`final`, when its reply is whole; a cancelled request's cut reply is the
    retriable error `request_cancelled` instead."""
    if final["finish"] == "cancelled":
        raise error_from_event(cancelled_error(final))
    return final


async def embeddings(sub: Submitted, req: EmbeddingRequest) -> dict[str, Any]:
    vectors: list[list[float]] = []
    tokens = 0
    async for event in sub.events():
        if event["t"] == "embedding":
            vectors = event["data"]
        elif event["t"] == "error":
            raise error_from_event(event)
        elif event["t"] == "done":
            tokens = event["usage"]["prompt_tokens"]
    data = []
    for i, vector in enumerate(vectors):
        value: Any = vector
        if req.encoding_format == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {"object": "list", "data": data, "model": req.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
