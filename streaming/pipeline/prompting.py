"""A call request's prompt: for our own models its messages as role + text (tool traffic
written the way the tool prompt teaches the model) after the tool prompt; for an
upstream server the caller's messages with their tool traffic native (inference/jobs.py
Message, as the request carries them); an upper bound of its tokens without the
model's tokenizer, and a lower one (a prompt no tokenizer could fit is refused
untokenized)."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from inference.jobs import ChatJob, Continuation, Message, conversation
from inference.spec import DeploymentSpec
from inference.structured.grammar import TOOL_MARKER, call_text
from sluice.errors import BadRequest
from streaming.pipeline.callrequest import CallRequest
from streaming.pipeline.structured import structured_body, tool_prompt

_MESSAGE_OVERHEAD = 8  # chat-template tokens around one message, generously
AFFINITY_CHARS = 4096  # the most text of a call's opening its prefix key reads
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


class Prompt(NamedTuple):
    """A call request as our own models read it: `structure` its checked tools and
    response format (structured.py), `messages` the tool prompt and the caller's
    messages as role and text, `turn` the caller's messages as that text (what its
    conversation keeps)."""

    structure: ChatJob
    messages: list[Message]
    turn: list[dict[str, str]]


def prompt_of(req: CallRequest) -> Prompt:
    """The prompt of a call request for our own models (an upstream deployment's job
    takes the request's native messages instead)."""
    structure = structured_body(req)
    custom = frozenset(t.name for t in req.tools if t.kind == "custom")
    turn = [rendered(m, custom) for m in req.messages]
    if structure.tools:
        turn_and_prompt = [*tool_prompt(structure.tools,
                                        parallel=structure.parallel_tool_calls), *turn]
    else:
        turn_and_prompt = turn
    messages: list[Message] = [{"role": m["role"], "content": m["content"]}
                               for m in turn_and_prompt]
    return Prompt(structure, messages, turn)


def chat_job(req: CallRequest, prompt: Prompt, messages: list[Message], *,
             history: list[Message], max_tokens: int,
             resume: Continuation | None = None, count_only: bool = False,
             cache_scope: str = "") -> ChatJob:
    """One attempt's job, built once: `messages` the prompt's (or, for an upstream
    deployment, the request's native ones), after `history` (the conversation's older
    turns, which the worker drops oldest first to fit; none for a raw prompt, whose
    last message's text is the prompt as it is); `resume` the reply another deployment
    began (its job is never kept); `count_only` counts the prompt, generating
    nothing; `cache_scope` narrows the prefix cache (governance/privacy.py)."""
    raw = req.raw_prompt
    structure = prompt.structure
    return ChatJob(
        messages=[] if raw else messages, prompt=messages[-1]["content"] if raw else None,
        history=[] if raw else history, max_tokens=max_tokens,
        temperature=req.temperature, top_p=req.top_p, seed=req.seed, stop=req.stop,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        logit_bias=req.logit_bias,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        stream=req.stream and not count_only, count_only=count_only,
        tools=structure.tools, tool_choice=structure.tool_choice,
        parallel_tool_calls=structure.parallel_tool_calls,
        response_format=structure.response_format, resume=resume,
        keep=req.keep if resume is None and not count_only else None,
        cache_scope=cache_scope)


def affinity_key(tenant: str, messages: list[Message], history: list[Message]) -> bytes:
    """A call's prefix key for placement (inference/routing.py): a hash of its tenant
    and its opening as the prompt has it (the tool prompt and instructions, then the
    first message after them: what every later turn of the conversation resends), at
    most AFFINITY_CHARS of their text."""
    ordered = conversation(messages, history)
    lead = 0
    while lead < len(ordered) and ordered[lead]["role"] in ("system", "developer"):
        lead += 1
    digest = hashlib.blake2b(tenant.encode() + b"\x1f", digest_size=16)
    left = AFFINITY_CHARS
    for message in ordered[:lead + 1]:
        text = message["content"][:left]
        digest.update(f"{message['role']}\x1e{text}\x1f".encode())
        left -= len(text)
        if left <= 0:
            break
    return digest.digest()
