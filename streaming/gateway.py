"""The gateway pipeline, written once for every protocol adapter.

    authenticate (cached) -> RBAC (model.use) -> model access (allow-list, enabled,
    kind) -> validate limits -> governance admission (rate limits, quota reservation,
    load shedding, memory guard, circuit breaker) -> enqueue on the deployment's queue
    -> events back (Submitted.events) -> governance settlement (real usage) and the
    call's audit event

Every adapter (REST, SSE, the WebSocket, gRPC, the Batch API) goes through here, so
each gets limits, quotas, breakers and audit at once; a chat call's `n` choices are
fanned out here too (streaming/choices.py).
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from django.conf import settings
from opentelemetry.trace import Status, StatusCode
from redis.exceptions import RedisError

from governance import metrics
from governance.admission import Admission, Governor
from governance.privacy import stored_messages
from inference.cache import enabled_spec
from inference.client import InferenceClient, RequestHandle
from inference.grammar import TOOL_MARKER
from inference.jobs import (
    ChatJob,
    EmbedJob,
    ErrorEvent,
    Event,
    FinalEvent,
    Job,
    default_max_tokens,
)
from inference.spec import DeploymentSpec, Kind
from sluice import telemetry
from sluice.db import async_db
from sluice.errors import (
    ApiError,
    BadRequest,
    DeadlineExceeded,
    NotFound,
    PermissionDenied,
    ServerError,
    Unauthenticated,
    Unavailable,
)
from streaming import choices, replay
from streaming.schemas import (
    ChatCompletionRequest,
    EmbeddingRequest,
)
from streaming.structured import structured_body, tool_prompt
from tenants.cache import authenticate_cached
from tenants.conversations import conversation_append, conversation_history
from tenants.principal import Principal
from tenants.roles import Action

_MESSAGE_OVERHEAD = 8  # chat-template tokens around one message, generously


@dataclass
class Submitted:
    """An admitted call: its queued request (`handle`; the first choice's when the call
    asks for n > 1, the others' in `more`), its admission and what settles it."""

    principal: Principal
    spec: DeploymentSpec
    handle: RequestHandle
    admission: Admission
    conversation_id: str | None = None
    messages: list[dict[str, str]] | None = None
    more: list[RequestHandle] = field(default_factory=list)
    charge: bool = True  # False: settled without charge (a token count)
    read: bool = False  # its events are being (or were) read: they settle it
    # The request's trace context and start, for the wait span and time to first token.
    trace_context: Any = field(default_factory=telemetry.current_context)
    began: float = field(default_factory=lambda: _began())

    @property
    def headers(self) -> dict[str, str]:
        """Response headers the pipeline adds (x-ratelimit-*, degradation notes)."""
        return self.admission.headers

    @property
    def handles(self) -> list[RequestHandle]:
        return [self.handle, *self.more]

    @property
    def charged(self) -> bool:
        """Whether settlement charges the call (an idempotent replay was charged once)."""
        return self.charge and not self.handle.replayed

    @property
    def ended(self) -> bool:
        """Every choice's final event arrived: there is nothing left to cancel."""
        return all(handle.finished for handle in self.handles)

    @property
    def n(self) -> int:
        return 1 + len(self.more)

    async def cancel(self) -> None:
        """Stop the call's generation on the worker, every choice of it."""
        await asyncio.gather(*(handle.cancel() for handle in self.handles))

    async def events(self) -> AsyncGenerator[Event]:
        """The call's events; settles its admission when they end (or, when the consumer
        stops early, once the worker's final events arrive). With n > 1 choices: every
        choice's events as they arrive, each tagged with its index (`"i"`; absent means
        0), ending after the last choice's final event (streaming/choices.py)."""
        finals: list[FinalEvent] = []
        self.read = True
        self.admission.request_id = self.handle.rid
        # Not the current span: a generator's consumer may resume it in another context.
        span = telemetry.child_span("sluice.wait", self.trace_context,
                                    {"sluice.request_id": self.handle.rid})
        first: float | None = None
        merged = choices.merged(self.handles) if self.more else None
        try:
            async for event in merged or self.handle.events():
                if event["t"] == "done" or event["t"] == "error":
                    finals.append(event)
                elif event["t"] == "delta":
                    if first is None:
                        first = time.perf_counter()
                        span.add_event("first_token")
                    if merged is None or event["i"] == 0:  # the audit's: the first choice
                        self.admission.note_reply(event.get("text", ""))
                yield event
        except BaseException as exc:
            if merged is not None:
                await merged.aclose()  # its readers of the n requests stop now
                choices.settle_later(self.admission, self.handles, finals, exc)
            else:
                self.admission.governor.finish_later(
                    self.admission, finals[0] if finals else None, exc, self.handle.rid,
                    self.handle.deadline_ms, charge=self.charged)
            self._observed(span, choices.combined(finals), first, exc)
            raise
        # Settlement, the audit event and the metrics (~0.15 ms of CPU, nothing awaited)
        # run at the loop's next turn: by then the adapter has written the reply, which
        # no longer waits for them. Their durations end here, not when they run.
        asyncio.get_running_loop().call_soon(
            self._settle, span, choices.combined(finals), first,
            (time.perf_counter(), time.time_ns()), time.monotonic())

    def _settle(self, span: Any, final: FinalEvent | None, first: float | None,
                ended: tuple[float, int], ended_monotonic: float) -> None:
        try:
            self._observed(span, final, first, None, ended)
        finally:
            self.admission.finish_now(final, charge=self.charged,
                                      ended=ended_monotonic)

    def _observed(self, span: Any, final: FinalEvent | None, first: float | None,
                  error: BaseException | None,
                  ended: tuple[float, int] | None = None) -> None:
        """End the wait span; time to first token and decode rate go to the metrics
        (`ended`: when the events ended, as perf_counter() and time_ns(); default now)."""
        prompt, completion = ((final["usage"]["prompt_tokens"],
                               final["usage"]["completion_tokens"]) if final is not None
                              else (0, 0))
        finish = final["finish"] if final is not None and final["t"] == "done" else ""
        failed = final["code"] if final is not None and final["t"] == "error" else None
        now, end_ns = ended if ended is not None else (time.perf_counter(), None)
        if span.is_recording():
            span.set_attributes({
                "gen_ai.usage.input_tokens": prompt, "gen_ai.usage.output_tokens": completion,
                "sluice.finish_reason": finish,
                "sluice.time_to_first_token_ms":
                    round((first - self.began) * 1000, 3) if first is not None else -1.0})
            if failed is not None or error is not None:
                code = failed or getattr(error, "code", None)
                span.set_attribute("error.type", str(code or type(error).__name__))
                span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=end_ns)
        if final is not None and self.charged:
            if first is not None:  # the dashboard's cluster-wide TTFT
                self.admission.governor.recorder.latency(
                    self.spec.name, (first - self.began) * 1000, metric="ttft")
            metrics.observe_generation(
                self.spec.name, ttft_s=first - self.began if first is not None else None,
                decode_s=now - first if first is not None else 0.0,
                prompt_tokens=prompt, completion_tokens=completion)


def queue_unavailable() -> Unavailable:
    """What a caller gets when Redis (the queue) fails under its call: retriable."""
    return Unavailable("The request queue is unavailable; try again shortly.",
                       code="queue_unavailable", headers={"Retry-After": "1"})


def _began() -> float:
    scope = telemetry.current_scope()
    return scope.began if scope is not None else time.perf_counter()


def prompt_bound(texts: list[str], spec: DeploymentSpec) -> int:
    """An upper bound of the prompt's tokens without the model's tokenizer: byte-level
    BPE makes at most one token per UTF-8 byte, plus the template's own tokens."""
    bound = sum(len(t.encode()) + _MESSAGE_OVERHEAD for t in texts) + 2 * _MESSAGE_OVERHEAD
    return min(bound, spec.max_context)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return "".join(str(p) for p in parts)


def _message(message: Any) -> dict[str, str]:
    """An OpenAI message as role + text, tool traffic written the way the tool prompt
    tells the model to write it."""
    content = _text(message.content)
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


def _chat_job(req: ChatCompletionRequest) -> tuple[ChatJob, list[dict[str, str]]]:
    """The job of a chat request (messages, the tool prompt before them, sampling,
    structure; no history, max_tokens or stream yet) and the turn its conversation
    keeps (the caller's messages)."""
    structured = structured_body(req)
    turn = [_message(m) for m in req.messages]
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


def error_from_event(event: ErrorEvent) -> ApiError:
    """A worker's error event as the typed error every adapter knows how to send. One
    the worker marks as certain to fail again (`"retry": false`: a model fault on this
    input, a dead-lettered request) tells the OpenAI SDKs not to retry it, as they
    would any 5xx (`x-should-retry: false`, a header they honour)."""
    status, code, message = event["status"], event["code"], event["message"]
    headers = {"x-should-retry": "false"} if event.get("retry") is False else None
    if status == 504:
        return DeadlineExceeded(message, code=code, headers=headers)
    if status == 503:
        return Unavailable(message, code=code, headers=headers)
    if 400 <= status < 500:
        return BadRequest(message, code=code, headers=headers)
    return ServerError(message, code=code, headers=headers)


class Gateway:
    def __init__(self) -> None:
        # One client and governor per event loop: their connections and tasks belong to
        # the loop that made them. A server has one loop; a process that runs several at
        # once (a test's loop beside a server thread's, a restarted server) gets one set
        # each, instead of one loop's calls replacing another's client under it.
        self._per_loop: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[InferenceClient, Governor]] = \
            weakref.WeakKeyDictionary()

    def _state(self) -> tuple[InferenceClient, Governor]:
        loop = asyncio.get_running_loop()
        state = self._per_loop.get(loop)
        if state is None:
            client = InferenceClient(settings.REDIS_URL)
            state = self._per_loop[loop] = (client, Governor(client))
        return state

    @property
    def client(self) -> InferenceClient:
        return self._state()[0]

    @property
    def governor(self) -> Governor:
        return self._state()[1]

    async def close(self) -> None:
        """Settle and write what this loop's calls reported, and close its client."""
        state = self._per_loop.pop(asyncio.get_running_loop(), None)
        if state is not None:
            client, governor = state
            await choices.close()
            await governor.close()
            await client.close()

    async def _submit(self, principal: Principal, spec: DeploymentSpec,
                      entries: Sequence[Job], admission: Admission,
                      timeout_s: float | None = None, **kw: Any) -> list[RequestHandle]:
        """Enqueue each of `entries` (a call's choices; all or none); the deadline is the
        server's timeout, or the caller's if sooner."""
        limit = float(settings.SLUICE_REQUEST_TIMEOUT_S)
        if timeout_s is not None:
            if timeout_s <= 0:
                await admission.release()
                raise DeadlineExceeded("The request's deadline passed before it was queued.")
            limit = min(limit, timeout_s)
        try:
            with telemetry.stage("sluice.enqueue", **{"sluice.deployment": spec.name}) as span:
                def submit(job: Job) -> Awaitable[RequestHandle]:
                    return self.client.submit(
                        spec, tenant=principal.tenant_slug, job=job, timeout_s=limit,
                        priority=principal.priority,
                        traceparent=telemetry.traceparent_of(span), **kw)
                handles = ([await submit(entries[0])] if len(entries) == 1
                           else await choices.submit_all(submit, entries))
                if span.is_recording():
                    span.set_attribute("sluice.request_id", handles[0].rid)
        except BaseException as exc:
            await admission.release()
            if isinstance(exc, RedisError):
                raise queue_unavailable() from None
            raise
        scope = telemetry.current_scope()
        if scope is not None:
            scope.request_id = handles[0].rid
        return handles

    async def authenticate(self, authorization: str | None, *,
                           source: str | None = None) -> Principal:
        """`source`: the client's address (tenants.throttle.client_source), which wrong
        keys count against; None counts none."""
        if not authorization or not authorization.lower().startswith("bearer "):
            raise Unauthenticated("You didn't provide an API key. Use 'Authorization: Bearer "
                                  "<key>'.")
        with telemetry.stage("sluice.auth") as span:
            principal = await authenticate_cached(authorization[7:], source=source)
            if span.is_recording():
                span.set_attributes({"sluice.tenant": principal.tenant_slug,
                                     "sluice.role": str(principal.role)})
        scope = telemetry.current_scope()
        if scope is not None:
            scope.tenant = principal.tenant_slug
        return principal

    async def _model(self, principal: Principal, name: str, kind: Kind) -> DeploymentSpec:
        if not principal.can(Action.MODEL_USE):
            raise PermissionDenied(f"Your role ({principal.role}) may not call models.")
        spec = await enabled_spec(name) if principal.may_use_model(name) else None
        if spec is None:
            raise NotFound(f"The model '{name}' does not exist or you do not have access to it.",
                           code="model_not_found", param="model")
        if spec.kind != kind:
            raise BadRequest(f"The model '{name}' is a {spec.kind.value} model.",
                             code="wrong_model_kind", param="model")
        scope = telemetry.current_scope()
        if scope is not None:
            scope.model = spec.name  # only a resolved deployment ever becomes a label
        return spec

    async def chat(self, principal: Principal, req: ChatCompletionRequest, *,
                   idempotency_key: str | None = None,
                   conversation_id: str | None = None, protocol: str = "rest",
                   timeout_s: float | None = None, stream: bool | None = None,
                   action: str = "chat.completions", raw_prompt: bool = False) -> Submitted:
        """Admit and enqueue one chat call (`req.n` choices: streaming/choices.py).
        `stream`: whether the caller consumes the reply token by token (default: the
        request's own `stream`); when it does not, the worker sends the reply in one
        piece at the end (no per-token events). `action`: the API's name in the call's
        audit event. `raw_prompt` (a legacy completion): the last message's text is
        the model's prompt as it is, without the chat template or any history."""
        spec = await self._model(principal, req.model, Kind.CHAT)
        conversation_id = req.conversation_id or conversation_id
        n = req.n or 1
        choices.check(n, idempotency_key=idempotency_key, conversation_id=conversation_id)
        history = (await async_db(conversation_history)(actor=principal,
                                                        public_id=conversation_id)
                   if conversation_id else [])
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is not None and max_tokens >= spec.max_context:
            raise BadRequest(f"max_tokens is {max_tokens}; this model's context is "
                             f"{spec.max_context} tokens.", param="max_tokens",
                             code="max_tokens_too_large")
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true.",
                             param="top_logprobs", code="invalid_value")
        job, turn = _chat_job(req)
        key, fingerprint = replay.idempotency(principal, idempotency_key, req)
        max_tokens = max_tokens or default_max_tokens(spec.max_context)
        texts = [m["content"] for m in job.messages] + [m.get("content", "") for m in history]
        # One admission for every choice: one request, n times the tokens.
        admission = await self._admit(principal, spec, action, protocol, job,
                                      tokens=n * (prompt_bound(texts, spec) + max_tokens))
        if admission.max_tokens_cap is not None:
            max_tokens = min(max_tokens, admission.max_tokens_cap)
        stream = req.stream if stream is None else stream
        if raw_prompt:
            job = msgspec.structs.replace(job, prompt=job.messages[-1]["content"],
                                          messages=[])
        else:
            # Older turns; the worker drops the oldest until the prompt fits (exact
            # token counts with the model's own tokenizer).
            job = msgspec.structs.replace(job, history=history)
        job = msgspec.structs.replace(job, max_tokens=max_tokens, stream=stream)
        handle, *more = await self._submit(
            principal, spec, choices.jobs(job, n), admission, timeout_s=timeout_s,
            idempotency_key=key, fingerprint=fingerprint,
            owner=replay.ownership(principal, req.model, conversation_id)
            if stream and n == 1 else None)
        return Submitted(principal, spec, handle, admission, conversation_id, turn, more)

    async def count(self, principal: Principal, req: ChatCompletionRequest, *,
                    action: str, protocol: str = "rest") -> Submitted:
        """Admit and enqueue a count of `req`'s prompt as the worker tokenizes it (the
        messages `chat` would send, tool prompt included; nothing generated): its final
        event's usage has the count. Admitted as a call (role, model access, limits,
        shedding) and settled without charge."""
        spec = await self._model(principal, req.model, Kind.CHAT)
        job, _turn = _chat_job(req)
        admission = await self._admit(principal, spec, action, protocol, job, tokens=0)
        # max_tokens 1: a worker that predates count_only still reports the exact
        # prompt count, after generating a single token.
        [handle] = await self._submit(principal, spec, [msgspec.structs.replace(
            job, max_tokens=1, stream=False, count_only=True)], admission)
        return Submitted(principal, spec, handle, admission, charge=False)

    async def _admit(self, principal: Principal, spec: DeploymentSpec, action: str,
                     protocol: str, job: ChatJob, *, tokens: int) -> Admission:
        admission = await self.governor.admit(principal, spec, tokens=tokens)
        admission.action, admission.protocol = action, protocol
        admission.request_text = next((m["content"] for m in reversed(job.messages)
                                       if m["role"] == "user"), "")
        return admission

    async def remember(self, sub: Submitted, reply: str) -> None:
        """Append the request's messages and the reply to its conversation."""
        if sub.conversation_id is not None:
            messages = [*(sub.messages or []), {"role": "assistant", "content": reply}]
            messages = await stored_messages(sub.principal, messages)
            await async_db(conversation_append)(
                actor=sub.principal, public_id=sub.conversation_id, messages=messages)

    async def embed(self, principal: Principal, req: EmbeddingRequest, *,
                    protocol: str = "rest", timeout_s: float | None = None) -> Submitted:
        spec = await self._model(principal, req.model, Kind.EMBEDDING)
        if req.dimensions is not None:
            raise BadRequest("This model does not support choosing dimensions.",
                             param="dimensions")
        inputs = [req.input] if isinstance(req.input, str) else req.input
        if any(not text for text in inputs):
            raise BadRequest("input must not contain empty strings.", param="input")
        admission = await self.governor.admit(
            principal, spec, tokens=sum(prompt_bound([t], spec) for t in inputs))
        admission.action, admission.protocol = "embeddings", protocol
        admission.request_text = inputs[0]
        [handle] = await self._submit(principal, spec, [EmbedJob(input=inputs)], admission,
                                      timeout_s=timeout_s)
        return Submitted(principal, spec, handle, admission)


_shared: Gateway | None = None


def shared_gateway() -> Gateway:
    """The process's gateway, shared by the lean HTTP app and the WebSocket consumers
    (one Redis client and one governance recorder per event loop)."""
    global _shared
    if _shared is None:
        _shared = Gateway()
    return _shared

