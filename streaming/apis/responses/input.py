"""The Responses API's input: its items (messages with text parts, function and custom
tool calls and their outputs, `additional_tools`) as stored items and as chat messages,
and validation errors worded as OpenAI does, naming the Responses field."""

from __future__ import annotations

import re
from secrets import token_hex
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, StringConstraints, ValidationError

from inference.jobs import Message, MessageToolCall
from sluice.errors import BadRequest
from streaming.apis.responses.tools import AdditionalTools, Name, Toolset, flat_name
from streaming.pipeline.schemas import validation_error


class _Item(BaseModel):
    # Items the SDKs send back are our own output items, with fields of ours (ids,
    # status, annotations) and sometimes of theirs: only what a turn needs is read.
    model_config = ConfigDict(extra="ignore")


# -- input items -------------------------------------------------------------------------
class _Message(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class _FunctionCall(_Item):
    type: Literal["function_call"]
    call_id: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    name: Name
    namespace: Name | None = None
    arguments: str


class _CustomCall(_Item):
    type: Literal["custom_tool_call"]
    call_id: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    name: Name
    namespace: Name | None = None
    input: str


class _FunctionCallOutput(_Item):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    output: str | list[dict[str, Any]]


_ITEMS: dict[str, type[_Item]] = {"message": _Message, "function_call": _FunctionCall,
                                  "function_call_output": _FunctionCallOutput,
                                  "custom_tool_call": _CustomCall,
                                  "custom_tool_call_output": _FunctionCallOutput}
_TEXT_PARTS = ("input_text", "output_text")


def _texts(parts: str | list[dict[str, Any]], where: str) -> list[str]:
    """The text of a content list (input_text / output_text parts); anything else is a
    400 naming the part."""
    if isinstance(parts, str):
        return [parts]
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise BadRequest(f"Content parts of type {str(kind)[:40]!r} are not supported; "
                             "send input_text parts.", param=f"{where}[{j}]",
                             code="unsupported_value")
        texts.append(part["text"])
    return texts


def input_items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as stored items, each with an id of its own: messages with
    text parts, function and custom tool calls and their outputs (`additional_tools`
    items are tools: `given_tools`)."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    items = []
    for i, raw in enumerate(given):
        kind = raw.get("type", "message")
        if kind == "additional_tools":
            continue
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise BadRequest(f"Input items of type {str(kind)[:40]!r} are not supported.",
                             param=f"input[{i}].type", code="unsupported_value")
        try:
            item = model.model_validate(raw)
        except ValidationError as exc:
            raise invalid(exc, f"input[{i}]") from None
        if isinstance(item, _Message):
            texts = _texts(item.content, f"input[{i}].content")
            part = "output_text" if item.role == "assistant" else "input_text"
            items.append({"id": f"msg_{token_hex(12)}", "type": "message", "role": item.role,
                          "status": "completed", "content": [
                              {"type": part, "text": t, **({"annotations": []}
                                                           if item.role == "assistant" else {})}
                              for t in texts]})
        elif isinstance(item, _FunctionCall | _CustomCall):
            custom = isinstance(item, _CustomCall)
            items.append({"id": f"{'ctc' if custom else 'fc'}_{token_hex(12)}",
                          "type": item.type, "status": "completed", "call_id": item.call_id,
                          "name": item.name,
                          **({"namespace": item.namespace} if item.namespace else {}),
                          **({"input": item.input} if isinstance(item, _CustomCall)
                             else {"arguments": item.arguments})})
        elif isinstance(item, _FunctionCallOutput):
            text = "".join(_texts(item.output, f"input[{i}].output"))
            items.append({"id": f"fco_{token_hex(12)}", "type": item.type,
                          "status": "completed", "call_id": item.call_id, "output": text})
    return items


def given_tools(tools: list[Any] | None, given_input: str | list[dict[str, Any]]) -> Toolset:
    """The request's tools: its `tools`, then those of its `additional_tools` items."""
    given: list[tuple[str, Any]] = [(f"tools[{i}]", t) for i, t in enumerate(tools or [])]
    if not isinstance(given_input, str):
        for i, raw in enumerate(given_input):
            if raw.get("type") == "additional_tools":
                try:
                    extra = AdditionalTools.model_validate(raw)
                except ValidationError as exc:
                    raise invalid(exc, f"input[{i}]") from None
                given += [(f"input[{i}].tools[{j}]", t) for j, t in enumerate(extra.tools)]
    return Toolset.of(given)


def chat_messages(items: list[dict[str, Any]]) -> list[Message]:
    """Items as the call's messages: a function call joins the assistant message before
    it (as its tool_calls), an output is a tool message."""
    out: list[Message] = []
    for item in items:
        kind = item.get("type")
        if kind == "message":
            out.append({"role": item["role"],
                        "content": "".join(p.get("text", "") for p in item["content"])})
        elif kind in ("function_call", "custom_tool_call"):
            call: MessageToolCall = {"id": item["call_id"], "type": "function", "function": {
                "name": flat_name(item["name"], item.get("namespace")),
                "arguments": (item["input"] if kind == "custom_tool_call"
                              else item["arguments"]) or "{}"}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": item["output"]})
    return out


# -- errors in the Responses API's names ---------------------------------------------------
_TAG = re.compile(r"^[a-z]+\[|^[A-Z]|^(str|int|float|bool|dict|list|none)$")

def _param(loc: tuple[Any, ...], prefix: str = "") -> str:
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _TAG.match(str(part)):  # a union member's tag, not a field
            out += f".{part}" if out else str(part)
    return out


def invalid(exc: ValidationError, prefix: str = "") -> BadRequest:
    """A validation error as OpenAI words it, naming the field as the Responses API
    does (`input[2].content`, a union member's tag left out)."""
    return validation_error(exc, lambda loc: _param(loc, prefix))
