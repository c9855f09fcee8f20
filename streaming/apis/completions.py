"""Legacy Completions, `POST /v1/completions`: a codec over the gateway's chat call.

Each prompt (`prompt` is a string or a list of them) is one gateway call whose single
user message is the prompt, asking for `n` choices; prompt p's choice j is the reply's
choice p * n + j, as OpenAI numbers them. The calls are admitted one after the other
(each its own rate-limit admission and quota reservation: a list of k prompts counts as
k requests); if one is refused, those already admitted are cancelled and the refusal is
the reply. Defaults are OpenAI's: `max_tokens` 16, `temperature` 1.

`echo` puts the prompt's text before each choice's completion (in a stream, as the
choice's first chunk). `logprobs` k (0 to 5) gives OpenAI's legacy shape from the chat
path's per-token entries: `tokens`, `token_logprobs`, `top_logprobs` (each a dict of
the k likeliest tokens, plus the sampled one when it is not among them) and
`text_offset` (each token's character offset in the choice's text). Refused with a 400
naming the field: `suffix`, `best_of` > 1, `echo` with `logprobs` (the prompt's own
tokens have no logprobs here), a prompt of token ids, an empty prompt, more than
MAX_SEQUENCES choices in all.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from inference.jobs import Event
from sluice.errors import BadRequest
from streaming.apis import Api, Context, bodies, register, sse
from streaming.apis.httpio import Send, send_json
from streaming.pipeline.callrequest import MAX_CHOICES, CallRequest, Params, args, stops
from streaming.pipeline.fold import Delta, Failure, Final, Fold
from streaming.pipeline.schemas import ModelName, StreamOptions, validation_error
from streaming.pipeline.submitted import Submitted

DEFAULT_MAX_TOKENS = 16  # OpenAI's, for this API
MAX_LOGPROBS = 5
MAX_PROMPTS = 16
MAX_SEQUENCES = 16  # prompts x n: each choice is a sequence in the running batch


class CompletionRequest(BaseModel):
    """The body of a legacy completion, as OpenAI's SDK sends it."""

    model_config = ConfigDict(extra="forbid")
    model: ModelName
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
    suffix: str | None = None  # refused unless empty
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None  # refused above 1
    logit_bias: Annotated[dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")],
                               Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=300)] | None = None
    seed: int | None = None
    user: Annotated[str, StringConstraints(max_length=256)] | None = None


# The reply, as the OpenAPI document describes it (streaming/transports/openapi.py).
class LegacyLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: LegacyLogprobs | None
    finish_reason: Literal["stop", "length", "content_filter"]


class TextCompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: TextCompletionUsage


class Completions(Api):
    path = "/v1/completions"
    action = "completions"
    params = Params({"messages": "prompt", "max_output_tokens": "max_tokens",
                     "top_logprobs": "logprobs"})

    async def serve(self, ctx: Context) -> None:
        req = parse(ctx.data)
        call = ctx.call
        call.model = req.model
        call.protocol = "sse" if req.stream else "rest"
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        # One admitted gateway call per prompt, all or none (the call cancels those
        # admitted when one is refused).
        subs = [await call.chat(call_request(req, prompt)) for prompt in prompts]
        async with call.watching(ctx.receive, resumable=False):
            fold = Fold(_events(subs, req.n or 1), len(prompts) * (req.n or 1))
            if req.stream:
                await _stream(ctx.send, req, prompts, subs, fold)
            else:
                body = await _completion(req, prompts, subs, fold)
                await send_json(ctx.send, 200, body, subs[-1].headers)


def parse(data: dict[str, Any]) -> CompletionRequest:
    """The request, or a 400 naming its field for what this API does not do."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and not all(isinstance(p, str) for p in prompt):
        raise BadRequest("prompt must be a string or a list of strings; prompts of token "
                         "ids are not supported.", param="prompt",
                         code="unsupported_parameter")
    try:
        req = CompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if req.suffix:
        raise BadRequest("suffix is not supported: this server does not insert text.",
                         param="suffix", code="unsupported_parameter")
    if req.best_of is not None and req.best_of > 1:
        raise BadRequest("best_of > 1 is not supported; use n for several choices.",
                         param="best_of", code="unsupported_parameter")
    if req.echo and req.logprobs is not None:
        raise BadRequest("echo cannot be combined with logprobs here (the prompt's tokens "
                         "have no logprobs).", param="echo", code="unsupported_parameter")
    if any(not p for p in prompts):
        raise BadRequest("prompt must not be empty.", param="prompt", code="invalid_value")
    if len(prompts) * (req.n or 1) > MAX_SEQUENCES:
        raise BadRequest(f"{len(prompts)} prompts with n = {req.n} ask for more than "
                         f"{MAX_SEQUENCES} choices.", param="n", code="invalid_value")
    return req


def call_request(req: CompletionRequest, prompt: str) -> CallRequest:
    """The call's request for one prompt: the prompt as the single user message, its
    text the model's prompt as it is (`raw_prompt`)."""
    return CallRequest(
        model=req.model, messages=[{"role": "user", "content": prompt}],
        max_output_tokens=req.max_tokens or DEFAULT_MAX_TOKENS, stream=req.stream,
        include_usage=req.stream_options is not None and req.stream_options.include_usage,
        stop=stops(req.stop), logprobs=req.logprobs is not None, raw_prompt=True,
        logit_bias={int(token): bias for token, bias in (req.logit_bias or {}).items()},
        **args(temperature=req.temperature, top_p=req.top_p, n=req.n, seed=req.seed,
               user=req.user, presence_penalty=req.presence_penalty,
               frequency_penalty=req.frequency_penalty, top_logprobs=req.logprobs))


async def _events(subs: list[Submitted], n: int) -> AsyncGenerator[Event]:
    """Every call's events as they arrive, `"i"` set to the reply's choice index."""
    if len(subs) == 1:
        async with contextlib.aclosing(subs[0].events()) as events:
            async for event in events:
                yield event
        return
    queue: asyncio.Queue[Event | BaseException | None] = asyncio.Queue()

    async def pump(p: int, sub: Submitted) -> None:
        try:
            async with contextlib.aclosing(sub.events()) as events:
                async for event in events:
                    event["i"] = p * n + event.get("i", 0)
                    queue.put_nowait(event)
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)  # this prompt's calls have ended

    # Closing a pump (an error, the client gone) closes its call's events: it settles.
    pumps = [asyncio.create_task(pump(p, sub)) for p, sub in enumerate(subs)]
    try:
        running = len(pumps)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


class _Offsets:
    """Character offsets of a choice's tokens in its text, from the tokens' bytes (a
    token may hold part of a character: it starts where that character does)."""

    def __init__(self, start: int = 0) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at = start

    def take(self, raw: bytes) -> int:
        at = self._at
        self._at += len(self._decoder.decode(raw))
        return at


def legacy_logprobs(entries: list[dict[str, Any]], offsets: _Offsets) -> dict[str, Any]:
    """OpenAI's legacy `logprobs` object for chat `logprobs.content` entries."""
    top: list[dict[str, float]] = []
    for entry in entries:
        likeliest = {alt["token"]: alt["logprob"] for alt in entry["top_logprobs"]}
        likeliest.setdefault(entry["token"], entry["logprob"])
        top.append(likeliest)
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": top,
            "text_offset": [offsets.take(bytes(e["bytes"])) for e in entries]}


def _base(req: CompletionRequest, subs: list[Submitted]) -> dict[str, Any]:
    return {"id": f"cmpl-{subs[0].handle.rid}", "object": "text_completion",
            "created": int(time.time()), "model": req.model, "system_fingerprint": None}


async def _completion(req: CompletionRequest, prompts: list[str], subs: list[Submitted],
                      fold: Fold) -> dict[str, Any]:
    n = req.n or 1
    reply = await fold.whole()
    choices = []
    for i, final in enumerate(reply.finals):
        text = prompts[i // n] + reply.texts[i] if req.echo else reply.texts[i]
        choices.append({"text": text, "index": i, "logprobs": None if req.logprobs is None
                        else legacy_logprobs(reply.lps[i], _Offsets()),
                        "finish_reason": bodies.finish_reason(final)})
    return {**_base(req, subs), "choices": choices, "usage": bodies.usage(reply.usage())}


async def _stream(send: Send, req: CompletionRequest, prompts: list[str],
                  subs: list[Submitted], fold: Fold) -> None:
    """SSE chunks of `text_completion` objects (choice i's with `index` i), a last
    usage chunk with `stream_options.include_usage`, then `data: [DONE]`."""

    n = req.n or 1
    base = _base(req, subs)

    def chunk(i: int, text: str, *, finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"text": text, "index": i, "logprobs": logprobs,
                                     "finish_reason": finish}]}

    offsets = [_Offsets() for _ in range(len(prompts) * n)]
    async with fold, sse.opened(send, fold, subs=subs) as out:
        async def emit(payload: dict[str, Any]) -> None:
            await out.send(b"data: %s\n\n" % orjson.dumps(payload))

        if req.echo:
            for i in range(len(prompts) * n):
                await emit(chunk(i, prompts[i // n]))
        async for piece in fold:
            if isinstance(piece, Delta) and (piece.text or piece.lp):
                lp = None if req.logprobs is None else legacy_logprobs(
                    piece.lp or [], offsets[piece.i])
                await emit(chunk(piece.i, piece.text, logprobs=lp))
            elif isinstance(piece, Failure):
                await emit(piece.error.body())
            elif isinstance(piece, Final):
                await emit(chunk(piece.i, "", finish=bodies.finish_reason(piece.event)))
        if req.stream_options is not None and req.stream_options.include_usage \
                and fold.done:
            counted = fold.usage()
            await emit({**base, "choices": [], "usage": {
                **bodies.usage(counted), **bodies.cost(subs[0] if subs else None, counted)}})
    await sse.last(send, out, b"data: [DONE]\n\n")


register(Completions())
