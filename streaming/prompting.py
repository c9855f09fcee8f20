"""A chat request as a job: for our own models its messages as role + text (tool traffic
written the way the tool prompt teaches the model) after the tool prompt; for an
upstream server the caller's messages with their tool traffic native (inference/jobs.py
Message); the sampling parameters; an upper bound of its tokens without the model's
tokenizer, and a lower one (a prompt no tokenizer could fit is refused untokenized)."""

from __future__ import annotations

from typing import Any

import msgspec

from inference.jobs import ChatJob, Message, MessageToolCall
from inference.spec import DeploymentSpec
from inference.structured.grammar import TOOL_MARKER, call_text
from sluice.errors import BadRequest
from streaming.schemas import ChatCompletionRequest
from streaming.structured import structured_body, tool_prompt

_MESSAGE_OVERHEAD = 8  # chat-template tokens around one message, generously
LONGEST_TOKEN_BYTES = 256  # prompt_floor's bound, with room for vocabularies we lack


def prompt_bound(texts: list[str], spec: DeploymentSpec) -> int:
    """An upper bound of the prompt's tokens without the model's tokenizer: byte-level
    BPE makes at most one token per UTF-8 byte, plus the template's own tokens."""
    bound = sum(len(t.encode()) + _MESSAGE_OVERHEAD for t in texts) + 2 * _MESSAGE_OVERHEAD
    return min(bound, spec.max_context)


def prompt_floor(texts: list[str]) -> int:
    """A lower bound of the prompt's tokens without the model's tokenizer: no token of
    any vocabulary we serve encodes more than LONGEST_TOKEN_BYTES bytes (SmolLM2's
    longest, a run of spaces, is 81)."""
    return -(-sum(len(t.encode()) for t in texts) // LONGEST_TOKEN_BYTES)


def refuse_unfitting(texts: list[str], spec: DeploymentSpec) -> None:
    """A 400 `context_length_exceeded` for a prompt that cannot fit `spec`'s context
    whatever its tokenizer, before anything tokenizes it."""
    if prompt_floor(texts) > spec.max_context:
        raise BadRequest(f"The prompt has more than {spec.max_context} tokens; this model's "
                         f"context is {spec.max_context}.", code="context_length_exceeded",
                         param="messages")


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


def rendered(message: Message, custom: frozenset[str] = frozenset()) -> dict[str, str]:
    """A message as our own models read it: role and text, tool traffic written the
    way the tool prompt tells the model to write it (a call of a tool named in
    `custom` with its raw input, as a custom tool's)."""
    content = message["content"]
    if message["role"] == "assistant" and "tool_calls" in message:
        content += "".join(
            TOOL_MARKER + call_text(c["function"]["name"], c["function"]["arguments"],
                                    custom=c["function"]["name"] in custom)
            for c in message["tool_calls"])
    elif message["role"] == "tool":
        content = f"[result of {message.get('tool_call_id', 'the call')}] {content}"
    return {"role": message["role"], "content": content}


def native_messages(req: ChatCompletionRequest) -> list[Message]:
    """The caller's messages as an upstream server gets them (tool traffic native)."""
    return [native_message(m, f"messages.{i}") for i, m in enumerate(req.messages)]


def chat_job(req: ChatCompletionRequest) -> tuple[ChatJob, list[dict[str, str]]]:
    """The job of a chat request for our own models (messages as text, the tool prompt
    before them, sampling, structure; no history, max_tokens or stream yet) and the
    turn its conversation keeps (the caller's messages as that text). An upstream
    deployment's job takes `native_messages` instead."""
    structured = structured_body(req)
    custom = frozenset(t.function.name for t in req.tools or () if t.function.custom is not None)
    turn = [rendered(m, custom) for m in native_messages(req)]
    if structured.tools and req.tools:
        turn_and_prompt = [*tool_prompt(structured.tools,
                                       parallel=structured.parallel_tool_calls),
                           *turn]
    else:
        turn_and_prompt = turn
    messages: list[Message] = [{"role": m["role"], "content": m["content"]}
                               for m in turn_and_prompt]
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return msgspec.structs.replace(
        structured, messages=messages, stop=stop, seed=req.seed,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias={int(token): bias for token, bias in (req.logit_bias or {}).items()},
        logprobs=(req.top_logprobs or 0) if req.logprobs else None), turn
