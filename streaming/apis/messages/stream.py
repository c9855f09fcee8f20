"""Anthropic Messages replies from a call's events: the message body, its SSE stream,
the error envelope, and their description in the OpenAPI document.

A stream is Anthropic's event sequence: `message_start`, then per content block
`content_block_start` / `content_block_delta` (text as `text_delta`, a tool call's input
as `input_json_delta`) / `content_block_stop`, one `ping` after the first block's start,
`message_delta` (stop_reason, stop_sequence, usage), `message_stop`. The text block opens
at the first text; a tool_use block at its call's first piece (the worker's `tools`
deltas), and its input follows in an `input_json_delta` per piece, as the model writes
it; a call that was not streamed (a worker that sends calls only with the final event)
gets its whole input in one. `message_start` is written once the first
event is in (the 200 waits for it anyway, so an error before any output is a plain
HTTP error), and reports that event's prompt count: a worker's first delta carries it,
a reply that is only tool calls has it in its final event; a worker that does not send
it early (an upstream deployment's) leaves 0 there, and `message_delta` has the real
figures either way (the SDK's accumulated message takes them). A worker error after the
stream began is an `error` event, and the stream ends without `message_stop`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import orjson
from pydantic import BaseModel

from inference.jobs import DoneEvent, ToolDelta
from sluice.errors import ApiError
from streaming.apis import bodies, sse
from streaming.pipeline.fold import Delta, Failure, Final, Fold
from streaming.pipeline.submitted import Submitted

if TYPE_CHECKING:
    from streaming.apis.httpio import Send

# Anthropic's error types by status (their API's error page); others by class.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                402: "billing_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status) or ("api_error" if status >= 500
                                        else "invalid_request_error")


def error_body(exc: ApiError) -> dict[str, Any]:
    """Anthropic's envelope: {"type": "error", "error": {"type", "message", "details"}}.
    Our stable code rides in `details.error_code`, where the SDK reads a cause's code
    (`APIStatusError.error_code`), beside any machine-readable extras (a quota's)."""
    openai = exc.body()["error"]  # the message redacted, as every error is
    details = {k: v for k, v in openai.items() if k not in ("message", "type", "param",
                                                            "code")}
    if exc.code:
        details = {"error_code": exc.code, **details}
    error: dict[str, Any] = {"type": error_type(exc.status), "message": openai["message"]}
    if details:
        error["details"] = details
    return {"type": "error", "error": error}


def stop_reason(final: DoneEvent) -> str:
    finish = final["finish"]
    if finish == "length":
        return "max_tokens"
    if finish == "tool_calls":
        return "tool_use"
    if finish == "content_filter":  # a guardrail stopped the reply
        return "refusal"
    return "stop_sequence" if final.get("stop_sequence") else "end_turn"


def tool_uses(final: DoneEvent) -> list[dict[str, Any]]:
    """The final event's tool calls as tool_use blocks (input an object)."""
    return [{"type": "tool_use", "id": _tool_id(call["id"]), "name": call["name"],
             "input": tool_input(call["arguments"])}
            for call in final.get("tool_calls") or ()]


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a tool_use block's `input`. Arguments that are not a JSON
    object (a call cut by max_tokens: stop_reason "max_tokens") are wrapped as
    Anthropic's fine-grained tool streaming guide wraps invalid tool input,
    `{"INVALID_JSON": "<the text as written>"}`: the block stays an object and keeps
    every character the model wrote. A stream sends a streamed call's text as written,
    in its `input_json_delta`s, as Anthropic does."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"INVALID_JSON": arguments}


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def usage(final: DoneEvent) -> dict[str, int]:
    counted = final["usage"]
    return {**input_usage(counted["prompt_tokens"], counted.get("cached_tokens", 0)),
            "output_tokens": counted["completion_tokens"]}


def input_usage(prompt: int, cached: int) -> dict[str, int]:
    """Anthropic's input counts: `input_tokens` are those after the last cache read
    (the prompt less what the model reused), `cache_read_input_tokens` the reused ones;
    Sluice writes no cache on request (cache_control is accepted, caching is automatic),
    so `cache_creation_input_tokens` is 0."""
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


async def message_body(sub: Submitted, model: str) -> dict[str, Any]:
    """The reply as one `message`; a worker error raises its ApiError."""
    text, final = await bodies.whole_reply(sub)
    content = [{"type": "text", "text": text}] if text else []
    return {"id": f"msg_{sub.handle.rid}", "type": "message", "role": "assistant",
            "model": model, "content": content + tool_uses(final),
            "stop_reason": stop_reason(final), "stop_sequence": final.get("stop_sequence"),
            "usage": usage(final)}


def _sse(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (name.encode(), orjson.dumps(payload))


async def stream(sub: Submitted, model: str, send: Send,
                 headers: dict[str, str]) -> None:
    """Send the call's events as Anthropic's SSE events. An error before any output is
    raised (a plain HTTP error in the API's shape); `headers` go with the 200."""
    fold = Fold(sub.events())
    async with fold, sse.opened(send, fold, headers=headers) as out:
        blocks = _Blocks(out.add)  # a worker event's frames leave in one write
        out.add(_sse("message_start", {"type": "message_start", "message": {
            "id": f"msg_{sub.handle.rid}", "type": "message", "role": "assistant",
            "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {**input_usage(fold.prompt_tokens, fold.cached_tokens),
                      "output_tokens": 0}}}))
        async for piece in fold:
            if isinstance(piece, Delta):
                if piece.text:
                    blocks.text(piece.text)
                if piece.tools is not None:
                    blocks.tools(piece.tools)
                await out.flush()
            elif isinstance(piece, Failure):
                out.add(_sse("error", error_body(piece.error)))
                break
            elif isinstance(piece, Final):
                blocks.finish(piece.event, bodies.cost(sub, piece.event["usage"]))
    await sse.last(send, out)


class _Blocks:
    """The content blocks of one streamed message, in order, each event's frame given
    to `write`."""

    _TEXT_DELTA = (b'event: content_block_delta\ndata: {"type":"content_block_delta",'
                   b'"index":%d,"delta":{"type":"text_delta","text":%s}}\n\n')

    _INPUT_DELTA = (b'event: content_block_delta\ndata: {"type":"content_block_delta",'
                    b'"index":%d,"delta":{"type":"input_json_delta","partial_json":%s}}\n\n')

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self._write = write
        self._count = 0
        self._text_open = False
        self._tool_open = False
        self._streamed: dict[int, str] = {}  # a streamed call's input so far, by index

    def _start(self, block: dict[str, Any]) -> None:
        self._write(_sse("content_block_start", {
            "type": "content_block_start", "index": self._count, "content_block": block}))
        if self._count == 0:
            self._write(_sse("ping", {"type": "ping"}))

    def _stop(self) -> None:
        self._write(_sse("content_block_stop",
                              {"type": "content_block_stop", "index": self._count}))
        self._count += 1

    def text(self, text: str) -> None:
        if not self._text_open:
            self._start({"type": "text", "text": ""})
            self._text_open = True
        # Most of a stream: the event's fixed bytes around the encoded text.
        self._write(self._TEXT_DELTA % (self._count, orjson.dumps(text)))

    def _close(self) -> None:
        if self._text_open or self._tool_open:
            self._stop()
            self._text_open = self._tool_open = False

    def _input(self, partial_json: str) -> None:
        self._write(self._INPUT_DELTA % (self._count, orjson.dumps(partial_json)))

    def tools(self, pieces: list[ToolDelta]) -> None:
        """Pieces of the calls being written: a call's first opens its block."""
        for piece in pieces:
            if "name" in piece:
                self._close()
                self._start({"type": "tool_use", "id": _tool_id(piece.get("id", "")),
                                   "name": piece["name"], "input": {}})
                self._tool_open = True
                self._streamed[piece["index"]] = ""
            if piece["arguments"] and piece["index"] in self._streamed:
                self._streamed[piece["index"]] += piece["arguments"]
                self._input(piece["arguments"])

    def finish(self, final: DoneEvent, cost: dict[str, str] | None = None) -> None:
        """The open blocks closed, then `message_delta` (its usage with `cost`, the
        call's `cost_usd` when priced) and `message_stop`."""
        calls = final.get("tool_calls") or []
        last = len(self._streamed) - 1
        if self._tool_open and 0 <= last < len(calls):
            # The open call's input as the final event has it, if anything is missing.
            whole, sent = calls[last]["arguments"], self._streamed[last]
            if whole.startswith(sent) and len(whole) > len(sent):
                self._input(whole[len(sent):])
        self._close()
        for use in tool_uses(final)[len(self._streamed):]:
            self._start({**use, "input": {}})
            self._input(orjson.dumps(use["input"]).decode())
            self._stop()
        if self._count == 0:
            self._write(_sse("ping", {"type": "ping"}))
        self._write(_sse("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(final),
                      "stop_sequence": final.get("stop_sequence")},
            "usage": {**usage(final), **(cost or {})}}))
        self._write(_sse("message_stop", {"type": "message_stop"}))


# -- what the OpenAPI document says the routes answer --------------------------------
class AnthropicTextBlock(BaseModel):
    type: Literal["text"]
    text: str


class AnthropicToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class AnthropicMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicTextBlock | AnthropicToolUseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicTokenCount(BaseModel):
    input_tokens: int


class AnthropicErrorObject(BaseModel):
    type: str
    message: str
    details: dict[str, Any] | None = None


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorObject


def openapi_operation(operation_id: str, summary: str, request: type[BaseModel],
                      response: type[BaseModel], *, description: str,
                      stream: bool = False) -> dict[str, Any]:
    """One Anthropic route's POST: its errors in Anthropic's envelope."""
    def ref(model: type[BaseModel]) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def error(text: str) -> dict[str, Any]:
        return {"description": text, "content": {"application/json": {
            "schema": ref(AnthropicError)}}}

    content: dict[str, Any] = {"application/json": {"schema": ref(response)}}
    if stream:  # OpenAPI 3.1: an event stream's schema describes each event
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"],
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}
    return {
        "operationId": operation_id, "tags": ["inference"], "summary": summary,
        "description": description,
        "security": [{"BearerAuth": []}],
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": ref(request)}}},
        "responses": {
            "200": {"description": "The reply", "content": content},
            "4XX": error("Refused, in Anthropic's error envelope (bad input, credentials, "
                         "role, unknown model, rate limit, quota, overload)."),
            "503": error("Overloaded or a dependency is away: retry after Retry-After"),
            "504": error("The deadline passed"),
        },
    }
