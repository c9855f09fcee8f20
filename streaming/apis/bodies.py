"""OpenAI response bodies built from a call's events (read through streaming/pipeline/fold.py):
written once, for the REST adapter, gRPC, WebSocket and the Batch API alike."""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from governance import pricing
from inference.jobs import DoneEvent, ToolCall, ToolDelta, Usage
from streaming.pipeline.callrequest import CallRequest
from streaming.pipeline.fold import Fold
from streaming.pipeline.schemas import ChatCompletionRequest, EmbeddingRequest
from streaming.pipeline.submitted import Submitted


def finish_reason(final: DoneEvent) -> str | None:
    """OpenAI's finish_reason of a choice's final event; None for a cancelled request
    (its reply is cut: never reported as finished, "stop"). A reply in one piece is
    never made of one (`all_done`)."""
    if final["finish"] == "cancelled":
        return None
    return _FINISH.get(final["finish"], "stop")


_FINISH = {"length": "length", "tool_calls": "tool_calls", "content_filter": "content_filter"}


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


def usage(counted: Usage) -> dict[str, Any]:
    """OpenAI's `usage` of a call's (its choices' summed: `Fold.usage`); its
    `prompt_tokens_details.cached_tokens`: the prompt tokens the model reused."""
    prompt, completion = counted["prompt_tokens"], counted["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": counted.get("cached_tokens", 0)}}


def cost(sub: Submitted | None, counted: Usage) -> dict[str, str]:
    """A stream's usage object's `cost_usd`: what `counted` costs at the call's price,
    the figure COST_HEADER gives a reply answered whole ({} when unpriced)."""
    nanos = sub.admission.price(counted) if sub is not None else None
    return {} if nanos is None else {"cost_usd": pricing.usd(nanos)}


def message(text: str, final: DoneEvent) -> dict[str, Any]:
    """A choice's assistant message: its tool calls when it made some, else its text."""
    if final.get("tool_calls"):
        return {"role": "assistant", "content": None,
                "tool_calls": tool_calls(final["tool_calls"])}
    return {"role": "assistant", "content": text}


async def whole_reply(sub: Submitted) -> tuple[str, DoneEvent]:
    """A one-choice call's whole text and its final event; a worker error raises its
    ApiError (the codecs that answer in one piece share this)."""
    reply = await Fold(sub.events()).whole()
    return reply.text, reply.final


async def chat_completion(sub: Submitted, req: ChatCompletionRequest | CallRequest
                          ) -> dict[str, Any]:
    """A `chat.completion` from the call's events, one choice per sequence (`sub.n`);
    a worker error (of any choice) raises its ApiError."""
    reply = await Fold(sub.events(), sub.n).whole()
    choices = []
    for i, final in enumerate(reply.finals):
        choices.append({"index": i, "message": message(reply.texts[i], final),
                        "finish_reason": finish_reason(final),
                        "logprobs": choice_logprobs(req, reply.lps[i])})
    body: dict[str, Any] = {
        "id": f"chatcmpl-{sub.handle.rid}", "object": "chat.completion",
        "created": int(time.time()), "model": req.model, "system_fingerprint": None,
        "choices": choices, "usage": usage(reply.usage()),
    }
    if sub.conversation_id is not None:
        body["conversation_id"] = sub.conversation_id
    return body


async def embeddings(sub: Submitted, req: EmbeddingRequest) -> dict[str, Any]:
    reply = await Fold(sub.events()).whole()
    tokens = reply.final["usage"]["prompt_tokens"]
    data = []
    for i, vector in enumerate(reply.vectors):
        value: Any = vector
        if req.encoding_format == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {"object": "list", "data": data, "model": req.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
