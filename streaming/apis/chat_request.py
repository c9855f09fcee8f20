"""Chat Completions' request side: its body (streaming/pipeline/schemas.py
ChatCompletionRequest, validated once at the edge) as the call's request
(streaming/pipeline/callrequest.py), and the API's names for the call's neutral parameters.
Every transport that carries a chat body (REST and SSE, the WebSocket, the Batch API)
reads it here."""

from __future__ import annotations

from typing import Any

from inference.jobs import Message, MessageToolCall, ResponseFormat, ToolSpec
from sluice.errors import BadRequest
from streaming.pipeline.callrequest import CallRequest, Params, json_schema, stops
from streaming.pipeline.schemas import ChatCompletionRequest, NamedToolChoice, parse

PARAMS = Params({"max_output_tokens": "max_tokens",
                 "response_format.schema": "response_format.json_schema.schema",
                 "tools[].parameters": "tools[].function.parameters"})


def parsed(data: Any) -> ChatCompletionRequest:
    """A chat body, or OpenAI's 400 naming the first field that is wrong."""
    return parse(ChatCompletionRequest, data)


# The body's fields that the call's request has under the same name and meaning.
_SAME = frozenset({"temperature", "top_p", "presence_penalty", "frequency_penalty", "n",
                   "seed", "top_logprobs", "parallel_tool_calls", "user", "metadata"})


def call_request(req: ChatCompletionRequest, *, stream: bool | None = None,
                 conversation_id: str | None = None, idempotency_key: str | None = None,
                 timeout_s: float | None = None) -> CallRequest:
    """The call's request for a chat body. `stream`: whether the caller reads the reply
    token by token (default: the body's own `stream`); `conversation_id` the one named
    outside the body (X-Sluice-Conversation-Id), when the body names none."""
    choice: str | None
    if isinstance(req.tool_choice, NamedToolChoice):
        choice, name = "function", req.tool_choice.function.name
    else:
        choice, name = req.tool_choice, None
    # Only what the body set (most set few): the rest are the request's defaults.
    same = {k: v for k in _SAME & req.model_fields_set if (v := getattr(req, k)) is not None}
    if req.logit_bias:
        same["logit_bias"] = {int(token): bias for token, bias in req.logit_bias.items()}
    return CallRequest(
        model=req.model,
        messages=[native_message(m, f"messages.{i}") for i, m in enumerate(req.messages)],
        tools=[ToolSpec(t.function.name, t.function.parameters, bool(t.function.strict),
                        t.function.description or "") for t in req.tools or ()],
        stop=stops(req.stop), logprobs=bool(req.logprobs),
        stream=req.stream if stream is None else stream,
        include_usage=req.stream_options is not None and req.stream_options.include_usage,
        tool_choice=choice, tool_name=name, response_format=_format(req),
        max_output_tokens=req.max_completion_tokens or req.max_tokens,
        conversation_id=req.conversation_id or conversation_id,
        idempotency_key=idempotency_key, timeout_s=timeout_s, **same)


def _format(req: ChatCompletionRequest) -> ResponseFormat | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.json_schema is None:
        raise BadRequest("Missing required parameter: 'response_format.json_schema'.",
                         param="response_format.json_schema",
                         code="missing_required_parameter")
    return json_schema(fmt.json_schema.schema_, strict=bool(fmt.json_schema.strict))


def message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return "".join(str(p) for p in parts)


def native_message(message: Any, where: str) -> Message:
    """An OpenAI message as a job carries it: its text, and its tool traffic (an
    assistant's `tool_calls`, a tool result's `tool_call_id`, a `name`) as fields.
    `where` names the message in a 400 when its tool calls are malformed."""
    out: Message = {"role": message.role, "content": message_text(message.content)}
    # Tool traffic rides in the message's extra fields (a plain getattr on a missing one
    # costs pydantic an exception: this runs for every message of every call).
    extra = message.model_extra or {}
    if not extra:
        return out
    if message.role == "assistant" and extra.get("tool_calls"):
        out["tool_calls"] = _tool_calls(extra["tool_calls"], f"{where}.tool_calls")
    if message.role == "tool" and extra.get("tool_call_id") is not None:
        out["tool_call_id"] = str(extra["tool_call_id"])
    if isinstance(extra.get("name"), str):
        out["name"] = extra["name"]
    return out


def _tool_calls(calls: Any, where: str) -> list[MessageToolCall]:
    out: list[MessageToolCall] = []
    for i, call in enumerate(calls if isinstance(calls, list) else [None]):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str | None):
            raise BadRequest(f"{where}.{i}: a tool call is {{\"id\", \"type\": \"function\", "
                             "\"function\": {\"name\", \"arguments\"}}.",
                             param=f"{where}.{i}", code="invalid_value")
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": name, "arguments": arguments or "{}"}})
    return out


