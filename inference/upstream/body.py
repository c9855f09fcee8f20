"""What Sluice sends an OpenAI-compatible upstream for a job, and how it reads the
chunks that come back. Pure: no I/O (inference/upstream/client.py does the sending).

Requests
- A chat job (its messages and history in `conversation` order) goes to
  /chat/completions, each message with its tool traffic native (an assistant's
  `tool_calls`, with null content when it said nothing else; a tool result's
  `tool_call_id`; a `name`); a legacy completion job (`prompt`) to /completions. Streamed, with
  `stream_options.include_usage`, so usage is the upstream's own count; a job whose
  reply nobody reads token by token (`stream` false) asks for one JSON reply instead
  (its usage is in it; the upstream does no per-token work for it).
- Passed through: max_tokens, temperature, top_p, seed, stop, presence and frequency
  penalties, logit_bias (token ids of the upstream's vocabulary), logprobs /
  top_logprobs, tools (name, description, parameters, strict), tool_choice, parallel_tool_calls,
  response_format (json_object, json_schema). What the dialect (inference/spec.py
  Dialect) accepts beyond OpenAI's parameters: `cache_salt` (vLLM: the tenant's salt,
  so prefix caches are never shared across tenants), `ignore_eos` (vLLM, SGLang).
  Nothing else of the caller's reaches the upstream: the model is the deployment's,
  the URL the registry's.
- A continuation (a takeover after a worker died mid-reply, or a model alias's call
  moved on after another deployment's upstream died mid-reply) sends the same request
  with the text already streamed as the reply's start, and asks only for the tokens
  still allowed:
  * legacy completions: `prompt` + the text, to /completions (every dialect);
  * chat, vLLM and SGLang: the text as a final assistant message with
    `continue_final_message: true, add_generation_prompt: false`, so the chat template
    leaves that message open and the model continues it;
  * chat, other dialects: not possible (OpenAI's API has no way to continue a
    message): `can_continue` is False and the call ends with a retriable error.

Replies
`ChunkReader` turns the SSE chunks of either endpoint (or a whole reply, read as one
chunk) into text, log-probability entries in the chat API's shape (the worker's `lp`),
tool-call fragments joined per index (and, per chunk, as the job's tool-call pieces),
the finish reason, the stop string (vLLM's `stop_reason`) and the usage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from secrets import token_hex
from typing import Any

from inference.jobs import (
    ChatJob,
    Continuation,
    Message,
    ToolCall,
    ToolDelta,
    Usage,
    conversation,
    usage,
)
from inference.spec import Dialect, UpstreamSpec
from inference.upstream.secrets import cache_salt

_SALTED = (Dialect.VLLM,)
_EXTENDED = (Dialect.VLLM, Dialect.SGLANG)  # continue_final_message, ignore_eos
_MESSAGE_KEYS = frozenset(("role", "content", "name", "tool_call_id", "tool_calls"))


def can_continue(job: ChatJob, dialect: Dialect) -> bool:
    return continues(dialect, prompt_only=job.prompt is not None)


def continues(dialect: Dialect, *, prompt_only: bool) -> bool:
    """Whether an upstream of `dialect` can continue a cut-off reply: a legacy
    completion's (`prompt_only`) everywhere, a chat reply on vLLM and SGLang only."""
    return prompt_only or dialect in _EXTENDED


def path_of(job: ChatJob) -> str:
    return "/completions" if job.prompt is not None else "/chat/completions"


def _message(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {k: v for k, v in message.items() if k in _MESSAGE_KEYS}
    if "tool_calls" in message and not message["content"]:
        out["content"] = None  # OpenAI's own shape of an assistant turn that only calls
    return out


def _structure(job: ChatJob) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if job.tools:
        out["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.parameters or {"type": "object"},
            **({"description": t.description} if t.description else {}),
            **({"strict": True} if t.strict else {})}} for t in job.tools]
        out["tool_choice"] = job.tool_choice if job.tool_choice in ("auto", "required") \
            else {"type": "function", "function": {"name": job.tool_choice}}
        out["parallel_tool_calls"] = job.parallel_tool_calls
    fmt = job.response_format
    if fmt is not None and fmt.type == "json_object":
        out["response_format"] = {"type": "json_object"}
    elif fmt is not None:
        out["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "response", "schema": fmt.schema or {"type": "object"},
            "strict": fmt.strict}}
    return out


def request_body(job: ChatJob, upstream: UpstreamSpec, *, tenant: str, max_tokens: int,
                 continuation: Continuation | None = None) -> dict[str, Any]:
    """The JSON body for `path_of(job)`. `max_tokens`: the reply's whole budget (the
    continuation's share is taken off here). Precondition: no continuation unless
    `can_continue(job, upstream.dialect)`."""
    done = continuation.completion_tokens if continuation is not None else 0
    body: dict[str, Any] = {
        "model": upstream.model, "stream": job.stream,
        "max_tokens": max(1, max_tokens - done), "temperature": job.temperature,
        "top_p": job.top_p,
    }
    if job.stream:
        body["stream_options"] = {"include_usage": True}
    if job.seed is not None:
        body["seed"] = job.seed
    if job.stop:
        body["stop"] = list(job.stop)
    if job.presence_penalty:
        body["presence_penalty"] = job.presence_penalty
    if job.frequency_penalty:
        body["frequency_penalty"] = job.frequency_penalty
    if job.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in job.logit_bias.items()}
    if upstream.dialect in _SALTED:
        body["cache_salt"] = cache_salt(tenant)
    if job.ignore_eos and upstream.dialect in _EXTENDED:
        body["ignore_eos"] = True
    if job.prompt is not None:
        body["prompt"] = job.prompt + (continuation.text if continuation else "")
        if job.logprobs is not None:
            body["logprobs"] = max(1, job.logprobs)
        return body
    messages = [_message(m) for m in conversation(job.messages, job.history)]
    if continuation is not None and continuation.text:
        messages.append({"role": "assistant", "content": continuation.text})
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    body["messages"] = messages
    if job.logprobs is not None:
        body["logprobs"] = True
        body["top_logprobs"] = job.logprobs
    body.update(_structure(job))
    return body


# -- replies ---------------------------------------------------------------------------
def _entry(token: str, logprob: float, top: list[dict[str, Any]]) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": top}


def _chat_logprobs(raw: Any) -> list[dict[str, Any]]:
    out = []
    for item in (raw or {}).get("content") or []:
        top = [{"token": t.get("token", ""), "logprob": t.get("logprob", 0.0),
                "bytes": t.get("bytes") or list(str(t.get("token", "")).encode())}
               for t in item.get("top_logprobs") or []]
        entry = _entry(str(item.get("token", "")), float(item.get("logprob", 0.0)), top)
        if item.get("bytes") is not None:
            entry["bytes"] = item["bytes"]
        out.append(entry)
    return out


def _legacy_logprobs(raw: Any) -> list[dict[str, Any]]:
    """/completions' {tokens, token_logprobs, top_logprobs} as chat entries."""
    if not raw:
        return []
    tokens, values = raw.get("tokens") or [], raw.get("token_logprobs") or []
    tops = raw.get("top_logprobs") or [None] * len(tokens)
    out = []
    for token, value, top in zip(tokens, values, tops, strict=False):
        alternatives = [{"token": t, "logprob": v, "bytes": list(t.encode())}
                        for t, v in (top or {}).items()]
        out.append(_entry(str(token), float(value if value is not None else 0.0),
                          alternatives))
    return out


@dataclass
class _Call:
    order: int  # its place among the reply's calls (the index of its pieces)
    id: str = ""
    name: str = ""
    arguments: str = ""
    announced: bool = False  # its first piece (id and name) is out


@dataclass
class ChunkReader:
    """Reads one streamed reply, chunk by chunk (`read`), then says how it ended.
    After each `read`, `pieces` are the tool-call pieces of that chunk (the job's
    DeltaEvent.tools): a call's first, once its name is in, has its id (the one
    `tool_calls` then reports) and name; later ones the next text of its arguments."""

    finish: str | None = None
    stop_sequence: str | None = None
    usage: Usage | None = None
    error: dict[str, Any] | None = None  # an error the upstream sent inside the stream
    pieces: list[ToolDelta] = field(default_factory=list)
    _calls: dict[int, _Call] = field(default_factory=dict)

    def read(self, chunk: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
        """The new text and log-probability entries of one chunk."""
        self.pieces = []
        if isinstance(chunk.get("error"), dict):
            self.error = chunk["error"]
            return "", []
        if isinstance(chunk.get("usage"), dict):
            got = chunk["usage"]
            prompt = int(got.get("prompt_tokens") or 0)
            details = got.get("prompt_tokens_details")
            # The upstream's own prefix cache (vLLM, SGLang, OpenAI), priced as cached
            # input; an untrusted count, kept within the prompt's.
            cached = int((details.get("cached_tokens") if isinstance(details, dict)
                          else 0) or 0)
            self.usage = usage(prompt, int(got.get("completion_tokens") or 0),
                               cached_tokens=max(0, min(cached, prompt)))
        choices = chunk.get("choices") or []
        if not choices:
            return "", []
        choice = choices[0]
        if choice.get("finish_reason"):
            self.finish = str(choice["finish_reason"])
        if isinstance(choice.get("stop_reason"), str):
            self.stop_sequence = choice["stop_reason"]
        if "text" in choice:  # /completions
            return str(choice.get("text") or ""), _legacy_logprobs(choice.get("logprobs"))
        delta = choice.get("delta") or choice.get("message") or {}  # a chunk, or all
        fragments = delta.get("tool_calls")
        if fragments:
            self._read_calls(fragments)
        return str(delta.get("content") or ""), _chat_logprobs(choice.get("logprobs"))

    def _read_calls(self, fragments: list[dict[str, Any]]) -> None:
        new: dict[int, str] = {}  # each call's new arguments text in this chunk, by order
        for i, fragment in enumerate(fragments):
            # A chunk's fragments carry their index; a whole reply's calls are in order.
            key = int(fragment.get("index", i))
            call = self._calls.get(key)
            if call is None:
                call = self._calls[key] = _Call(len(self._calls))
            call.id = call.id or str(fragment.get("id") or "")
            function = fragment.get("function") or {}
            call.name += str(function.get("name") or "")
            text = str(function.get("arguments") or "")
            call.arguments += text
            new[call.order] = new.get(call.order, "") + text
        # A call is announced, in order, once its name is surely whole: its arguments
        # have begun, or a later call has (a name may come in fragments).
        calls = sorted(self._calls.values(), key=lambda c: c.order)
        for k, call in enumerate(calls):
            if call.announced:
                if new.get(call.order):
                    self.pieces.append({"index": call.order, "arguments": new[call.order]})
                continue
            if not call.name or not (call.arguments or k + 1 < len(calls)):
                break  # later calls wait for this one: pieces come in the calls' order
            call.announced = True
            call.id = call.id or f"call_{token_hex(12)}"
            self.pieces.append({"index": call.order, "id": call.id, "name": call.name,
                                "arguments": call.arguments})

    def tool_calls(self) -> list[ToolCall]:
        return [{"id": c.id or f"call_{token_hex(12)}", "name": c.name,
                 "arguments": c.arguments or "{}"}
                for _, c in sorted(self._calls.items())]
