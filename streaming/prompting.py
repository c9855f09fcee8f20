"""A chat request as the worker's prompt: its messages as role + text (tool traffic
written the way the tool prompt teaches the model), the tool prompt before them, the
sampling parameters, and an upper bound of its tokens without the model's tokenizer."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from inference.grammar import TOOL_MARKER
from inference.jobs import ChatJob
from inference.spec import DeploymentSpec
from streaming.schemas import ChatCompletionRequest
from streaming.structured import structured_body, tool_prompt

_MESSAGE_OVERHEAD = 8  # chat-template tokens around one message, generously


def prompt_bound(texts: list[str], spec: DeploymentSpec) -> int:
    """An upper bound of the prompt's tokens without the model's tokenizer: byte-level
    BPE makes at most one token per UTF-8 byte, plus the template's own tokens."""
    bound = sum(len(t.encode()) + _MESSAGE_OVERHEAD for t in texts) + 2 * _MESSAGE_OVERHEAD
    return min(bound, spec.max_context)


def message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return "".join(str(p) for p in parts)


def chat_message(message: Any) -> dict[str, str]:
    """An OpenAI message as role + text, tool traffic written the way the tool prompt
    tells the model to write it."""
    content = message_text(message.content)
    if message.role not in ("assistant", "tool"):
        return {"role": message.role, "content": content}
    # Tool traffic rides in the message's extra fields (a plain getattr on a missing one
    # costs pydantic an exception: this runs for every message of every call).
    extra = message.model_extra or {}
    calls = extra.get("tool_calls") or []
    if message.role == "assistant" and calls:
        content += "".join(
            f'{TOOL_MARKER}{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
            f'{c["function"].get("arguments") or "{}"}}}' for c in calls)
    if message.role == "tool":
        content = f"[result of {extra.get('tool_call_id', 'the call')}] {content}"
    return {"role": message.role, "content": content}


def chat_job(req: ChatCompletionRequest) -> tuple[ChatJob, list[dict[str, str]]]:
    """The job of a chat request (messages, the tool prompt before them, sampling,
    structure; no history, max_tokens or stream yet) and the turn its conversation
    keeps (the caller's messages)."""
    structured = structured_body(req)
    turn = [chat_message(m) for m in req.messages]
    messages = list(turn)
    if structured.tools and req.tools:
        messages[:0] = tool_prompt(req.tools, parallel=structured.parallel_tool_calls)
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return msgspec.structs.replace(
        structured, messages=messages, stop=stop, seed=req.seed,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias={int(token): bias for token, bias in (req.logit_bias or {}).items()},
        logprobs=(req.top_logprobs or 0) if req.logprobs else None), turn
