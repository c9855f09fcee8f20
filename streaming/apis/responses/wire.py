"""The Responses API's wire shapes: the response object, its output items and usage, and
the SSE event stream of a streamed call (streaming/apis/responses/codec.py parses requests).

A stream is OpenAI's event sequence, every event numbered by `sequence_number` from 0:
`response.created`, `response.in_progress`; for text, `response.output_item.added` (a
message), `response.content_part.added`, `response.output_text.delta`..., then
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`;
for each function call, `response.output_item.added`,
`response.function_call_arguments.delta` (one per piece as the model writes the
arguments, when the worker streams its calls; else one with them whole) / `.done`,
`response.output_item.done`; a custom tool's call the same with
`response.custom_tool_call_input.delta` / `.done`; last
`response.completed`, `response.incomplete` (max_output_tokens reached) or
`response.failed` (the generation failed after it began). Each is sent as
`event: <type>` and `data: <json>`; no `[DONE]` follows (OpenAI sends none here).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import orjson
from pydantic import BaseModel

from inference.jobs import DoneEvent, ToolCall, ToolDelta
from sluice.errors import ApiError
from streaming.apis import bodies


@dataclass(frozen=True)
class Origin:
    """What a call's flat function name stands for: a function or a custom tool, in a
    namespace or not (streaming/apis/responses/tools.py)."""

    kind: Literal["function", "custom"]
    name: str
    namespace: str | None = None


# What a call's (flat) function name stands for: a function or a custom tool, in a
# namespace or not (streaming/apis/responses/tools.py Toolset.origin).
Names = Callable[[str], Origin]


def _plain(name: str) -> Origin:
    return Origin("function", name)


class Frames(Protocol):
    """Where a stream's encoded events go (streaming/apis/httpio.py KeepAlive)."""

    def add(self, body: bytes) -> None: ...


# -- the response object ----------------------------------------------------------------
def usage(final: DoneEvent) -> dict[str, Any]:
    counted = bodies.usage(final["usage"])
    return {"input_tokens": counted["prompt_tokens"],
            "input_tokens_details": counted["prompt_tokens_details"],
            "output_tokens": counted["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counted["total_tokens"]}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)]}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: ToolCall, status: str = "completed",
              arguments: str | None = None, names: Names = _plain) -> dict[str, Any]:
    """A function_call item, or a custom_tool_call item (its `input`), with `namespace`
    when the tool is in one."""
    origin = names(call["name"])
    text = call["arguments"] if arguments is None else arguments
    custom = origin.kind == "custom"
    return {"id": item_id, "type": "custom_tool_call" if custom else "function_call",
            "status": status, "call_id": call["id"], "name": origin.name,
            **({"namespace": origin.namespace} if origin.namespace else {}),
            ("input" if custom else "arguments"): text}


def _status(final: DoneEvent) -> str:
    return "incomplete" if final.get("finish") in _INCOMPLETE else "completed"


# Why a response is incomplete (OpenAI's incomplete_details.reason) by the finish.
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def output(rid: str, text: str, final: DoneEvent,
           names: Names = _plain) -> list[dict[str, Any]]:
    """The output items of a finished call: its text as a message (also when it said
    nothing and called nothing), then one item per function call."""
    calls = final.get("tool_calls") or []
    items = [message_item(f"msg_{rid}", text, _status(final))] if text or not calls else []
    return items + [call_item(f"fc_{rid}_{k}", call, _call_status(final, k), names=names)
                    for k, call in enumerate(calls)]


def _call_status(final: DoneEvent, k: int) -> str:
    """A finished call's item status: "incomplete" for the last call of a reply cut by
    max_output_tokens (its arguments as far as they were written, not valid JSON)."""
    cut = final.get("finish") == "length" and k == len(final.get("tool_calls") or []) - 1
    return "incomplete" if cut else "completed"


def finished(head: dict[str, Any], items: list[dict[str, Any]],
             final: DoneEvent) -> dict[str, Any]:
    """The response object once the call ended with `final` (a worker's done event)."""
    status = _status(final)
    return {**head, "status": status, "output": items, "usage": usage(final),
            # The worker's time when it kept the reply: the stored copy says the same.
            "completed_at": final.get("kept_at") or int(time.time())
            if status == "completed" else None,
            "incomplete_details": {"reason": _INCOMPLETE[final["finish"]]}
            if status == "incomplete" else None}


def failed(head: dict[str, Any], items: list[dict[str, Any]],
           error: ApiError) -> dict[str, Any]:
    """The response object of a call whose generation failed after it began."""
    code = "rate_limit_exceeded" if error.status == 429 else "server_error"
    return {**head, "status": "failed", "output": items,
            "error": {"code": code, "message": error.message}}


# -- the event stream --------------------------------------------------------------------
class EventStream:
    """Encodes one call as the Responses API's events over a started SSE response.

    `start` adds created / in_progress; `text` each delta (opening the message item at
    the first); `calls` the pieces of calls being written (an item per call, opened at
    its first); `end` closes the open items, adds the function calls, and returns the
    final response object, which `close` then adds as completed / incomplete / failed.
    Events are queued on `out` (KeepAlive.add): the caller flushes them once per
    worker event and sends what is left with the stream's last message."""

    def __init__(self, out: Frames, head: dict[str, Any], rid: str,
                 names: Names = _plain) -> None:
        self.out, self.head, self.rid, self.names = out, head, rid, names
        self.seq = 0
        self.parts: list[str] = []
        self.message_open = False
        self.items: list[dict[str, Any]] = []
        self.item_id = f"msg_{rid}"
        self.streamed: list[tuple[ToolDelta, str]] = []  # each open call: first piece, args
        # A text delta is most of a stream: its frame is fixed bytes around the
        # sequence number and the encoded text, not a dict encoded afresh per token.
        self._delta_head = (
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
            b'"item_id":"' + self.item_id.encode() + b'","output_index":0,'
            b'"content_index":0,"logprobs":[],"sequence_number":')

    def emit(self, kind: str, payload: dict[str, Any]) -> None:
        payload = {"type": kind, **payload, "sequence_number": self.seq}
        self.seq += 1
        self.out.add(b"event: %s\ndata: %s\n\n" % (kind.encode(), orjson.dumps(payload)))

    def start(self) -> None:
        snapshot = {**self.head, "status": "in_progress"}
        self.emit("response.created", {"response": snapshot})
        self.emit("response.in_progress", {"response": snapshot})

    def text(self, delta: str) -> None:
        if not self.message_open:
            self._open_message()
        self.parts.append(delta)
        frame = b"%s%d,\"delta\":%s}\n\n" % (self._delta_head, self.seq, orjson.dumps(delta))
        self.seq += 1
        self.out.add(frame)

    def _open_message(self) -> None:
        self.message_open = True
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        self.emit("response.output_item.added", {
            "output_index": 0, "item": {**message_item(self.item_id, "", "in_progress"),
                                        "content": []}})
        self.emit("response.content_part.added", {**where, "part": text_part("")})

    def _close_message(self, status: str) -> None:
        text = "".join(self.parts)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        self.emit("response.output_text.done", {**where, "text": text, "logprobs": []})
        self.emit("response.content_part.done", {**where, "part": text_part(text)})
        item = message_item(self.item_id, text, status)
        self.emit("response.output_item.done", {"output_index": 0, "item": item})
        self.items.append(item)
        self.message_open = False

    def _where(self, k: int) -> dict[str, Any]:
        return {"item_id": f"fc_{self.rid}_{k}", "output_index": len(self.items) + k}

    def calls(self, pieces: list[ToolDelta]) -> None:
        """Pieces of the calls being written (a reply's calls follow its text, if any)."""
        for piece in pieces:
            k = piece["index"]
            if "name" in piece and k == len(self.streamed):
                if self.message_open:
                    self._close_message("completed")
                self.streamed.append((piece, ""))
                call: ToolCall = {"id": piece.get("id", ""), "name": piece["name"],
                                  "arguments": ""}
                self.emit("response.output_item.added", {
                    "output_index": self._where(k)["output_index"],
                    "item": call_item(self._where(k)["item_id"], call, "in_progress",
                                      names=self.names)})
            if piece["arguments"] and k < len(self.streamed):
                first, sent = self.streamed[k]
                self.streamed[k] = (first, sent + piece["arguments"])
                self.emit(self._event(first["name"], "delta"),
                          {**self._where(k), "delta": piece["arguments"]})

    def _event(self, name: str, which: str) -> str:
        """A call's delta / done event type: a function's arguments, a custom tool's
        input."""
        return (f"response.custom_tool_call_input.{which}"
                if self.names(name).kind == "custom"
                else f"response.function_call_arguments.{which}")

    def end(self, final: DoneEvent) -> dict[str, Any]:
        """Close the call's output after its final event; the response object."""
        calls = final.get("tool_calls") or []
        if self.message_open or not (calls or self.streamed):
            if not self.message_open:
                self._open_message()
            self._close_message(_status(final))
        streamed, self.streamed = self.streamed, []
        for k, call in enumerate(calls):
            index, item_id = len(self.items), f"fc_{self.rid}_{k}"
            where = {"item_id": item_id, "output_index": index}
            sent = streamed[k][1] if k < len(streamed) else None
            if sent is None:
                self.emit("response.output_item.added", {
                    "output_index": index,
                    "item": call_item(item_id, call, "in_progress", arguments="",
                                      names=self.names)})
                sent = ""
            if len(call["arguments"]) > len(sent) and call["arguments"].startswith(sent):
                self.emit(self._event(call["name"], "delta"),
                          {**where, "delta": call["arguments"][len(sent):]})
            status = _call_status(final, k)
            if status == "completed":  # a cut call's arguments are not done: only its item
                origin = self.names(call["name"])
                self.emit(self._event(call["name"], "done"), {
                    **where, "input": call["arguments"]} if origin.kind == "custom" else {
                    **where, "name": origin.name, "arguments": call["arguments"]})
            item = call_item(item_id, call, status, names=self.names)
            self.emit("response.output_item.done", {"output_index": index, "item": item})
            self.items.append(item)
        for first, sent in streamed[len(calls):]:  # cut short (the reply's length)
            call = {"id": first.get("id", ""), "name": first["name"], "arguments": sent}
            item = call_item(f"fc_{self.rid}_{first['index']}", call, "incomplete",
                             names=self.names)
            self.emit("response.output_item.done", {"output_index": len(self.items),
                                                          "item": item})
            self.items.append(item)
        return finished(self.head, self.items, final)

    def fail(self, error: ApiError) -> dict[str, Any]:
        """The generation failed after it began: the open message ends incomplete; the
        failed response object."""
        if self.message_open:
            self._close_message("incomplete")
        return failed(self.head, self.items, error)

    def close(self, body: dict[str, Any]) -> None:
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            body["status"], "response.failed")
        self.emit(kind, {"response": body})


# -- the OpenAPI document's description of a response object -------------------------------
class ResponsesOutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ResponsesOutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponsesOutputText]


class ResponsesFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"]
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    namespace: str | None = None
    arguments: str  # JSON text


class ResponsesCustomToolCall(BaseModel):
    id: str
    type: Literal["custom_tool_call"]
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    namespace: str | None = None
    input: str


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    completed_at: int | None
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    model: str
    output: list[ResponsesOutputMessage | ResponsesFunctionCall | ResponsesCustomToolCall]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: str
    usage: ResponsesUsage | None
    user: str | None
    background: bool
    reasoning: dict[str, Any]
    # Echoed hints (absent from responses stored before they were echoed).
    service_tier: Literal["default"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
