"""The gateway pipeline, written once for every protocol adapter.

    authenticate (cached) -> RBAC (model.use) -> model access (allow-list, enabled,
    kind) -> validate limits -> governance admission (rate limits, quota reservation,
    load shedding, memory guard, circuit breaker) -> enqueue on the deployment's queue
    -> events back (Submitted.events) -> governance settlement (real usage) and the
    call's audit event

Every adapter (REST, SSE, the WebSocket, gRPC, the Batch API) goes through here,
through one call object (streaming/pipeline/call.py), so each gets limits, quotas, breakers and
audit at once; a chat call's `n` choices are fanned out here too (streaming/pipeline/choices.py).
A chat call's request is a CallRequest (streaming/pipeline/callrequest.py), which every codec
builds once; it becomes one typed job per attempt (streaming/pipeline/prompting.py,
inference/jobs.py); an admitted call is a Submitted (streaming/pipeline/submitted.py).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Sequence
from typing import Any, cast

import msgspec
from django.conf import settings
from redis.exceptions import RedisError

from governance.admission import Admission, Governor
from governance.privacy import cache_scope, stored_messages
from governance.refusals import FALLBACK_HEADER
from inference.cache import enabled_spec
from inference.client import InferenceClient, RequestHandle
from inference.jobs import (
    ChatJob,
    EmbedJob,
    Job,
    Message,
    default_max_tokens,
)
from inference.routing import Route
from inference.selectors import alias_route
from inference.spec import DeploymentSpec, Kind, MaxTokensPolicy, RuntimeName
from inference.structured.grammar_check import GrammarChecker
from sluice.db import async_db
from sluice.errors import (
    BadRequest,
    BudgetExceeded,
    DeadlineExceeded,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from sluice.observability import telemetry
from streaming.pipeline import choices, max_tokens_policy, replay
from streaming.pipeline.callrequest import CallRequest, check
from streaming.pipeline.failures import queue_unavailable
from streaming.pipeline.guarding import Guarding, guarded
from streaming.pipeline.prompting import (
    affinity_key,
    chat_job,
    prompt_bound,
    prompt_of,
    refuse_unfitting,
    rendered,
)
from streaming.pipeline.routed import Attempt, Routed, RoutedAdmission, call_bound
from streaming.pipeline.schemas import EmbeddingRequest
from streaming.pipeline.structured import check_grammar
from streaming.pipeline.submitted import Submitted
from tenants.cache import authenticate_cached
from tenants.conversations import conversation_append, conversation_history
from tenants.principal import Principal
from tenants.roles import Action


class Gateway:
    def __init__(self) -> None:
        # One client and governor per event loop: their connections and tasks belong to
        # the loop that made them. A server has one loop; a process that runs several at
        # once (a test's loop beside a server thread's, a restarted server) gets one set
        # each, instead of one loop's calls replacing another's client under it.
        self._per_loop: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[InferenceClient, Governor, GrammarChecker]] = \
            weakref.WeakKeyDictionary()

    def _state(self) -> tuple[InferenceClient, Governor, GrammarChecker]:
        loop = asyncio.get_running_loop()
        state = self._per_loop.get(loop)
        if state is None:
            client = InferenceClient(settings.REDIS_URL)
            state = self._per_loop[loop] = (client, Governor(client), GrammarChecker(
                processes=settings.SLUICE_GRAMMAR_CHECK_PROCESSES,
                budget_s=settings.SLUICE_GRAMMAR_CHECK_BUDGET_S,
                memory_mb=settings.SLUICE_GRAMMAR_CHECK_MEMORY_MB))
        return state

    @property
    def client(self) -> InferenceClient:
        return self._state()[0]

    @property
    def governor(self) -> Governor:
        return self._state()[1]

    @property
    def grammars(self) -> GrammarChecker:
        return self._state()[2]

    async def close(self) -> None:
        """Settle and write what this loop's calls reported, and close its client and
        its grammar checker's processes."""
        state = self._per_loop.pop(asyncio.get_running_loop(), None)
        if state is not None:
            client, governor, grammars = state
            await choices.close()
            await governor.close()
            await client.close()
            await grammars.close()

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
            # A deadline the caller chose is not the deployment's failure (its breaker).
            # An alias call's attempt gets what is left of the call's deadline, whoever
            # chose it: counted as the platform's, as the tenant alone cannot open a
            # breaker for others anyway (governance/breaker.py).
            admission.caller_deadline = timeout_s < limit and \
                not isinstance(admission, RoutedAdmission)
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

    async def _model(self, principal: Principal, name: str, kind: Kind
                     ) -> DeploymentSpec | Route:
        """The deployment `name` names, or the model alias (when no enabled deployment
        has that name: streaming/pipeline/routed.py); the caller's key must allow `name`."""
        if not principal.can(Action.MODEL_USE):
            raise PermissionDenied(f"Your role ({principal.role}) may not call models.")
        allowed = principal.may_use_model(name)
        spec = await enabled_spec(name) if allowed else None
        if spec is None:
            route = await alias_route(name) if allowed else None
            if route is not None:
                return route
            raise NotFound(f"The model '{name}' does not exist or you do not have access to it.",
                           code="model_not_found", param="model")
        if spec.kind != kind:
            raise BadRequest(f"The model '{name}' is a {spec.kind.value} model.",
                             code="wrong_model_kind", param="model")
        scope = telemetry.current_scope()
        if scope is not None:
            scope.model = spec.name  # only a resolved deployment ever becomes a label
        return spec

    def _routed(self, route: Route, kind: Kind, attempt: Attempt, *, texts: list[str],
                max_tokens: int | None, timeout_s: float | None,
                prompt_only: bool = False, droppable: list[str] | None = None,
                affinity: bytes | None = None) -> Awaitable[Submitted]:
        """An alias call: planned, then its first admitted attempt (streaming/pipeline/routed.py).
        `droppable`: the texts of history the worker may drop to fit (not in `texts`);
        `affinity`: the call's prefix key (prompting.affinity_key)."""
        limit = float(settings.SLUICE_REQUEST_TIMEOUT_S)
        if timeout_s is not None:
            limit = min(limit, timeout_s)
        return Routed.start(route, kind, attempt, redis=self.client.redis,
                            bound=call_bound([*texts, *(droppable or ())], max_tokens),
                            reply=max_tokens or 0,
                            trimmed=call_bound(texts, max_tokens) if droppable else None,
                            timeout_s=limit, prompt_only=prompt_only, affinity=affinity)

    async def chat(self, principal: Principal, req: CallRequest, *, protocol: str = "rest",
                   action: str = "chat.completions") -> Submitted:
        """Admit and enqueue one chat call (`req.n` choices: streaming/pipeline/choices.py).
        `action`: the API's name in the call's audit event. A caller that does not
        read the reply token by token (`req.stream` false) gets it in one piece at the
        end (no per-token events). `req.earlier` joins the conversation's history: the
        worker may drop it to fit. Errors name the request's neutral parameters
        (streaming/pipeline/callrequest.py).

        A budget that refuses the call and names a fallback model sends it there
        instead, once (the fallback's own refusal stands), with FALLBACK_HEADER saying
        so; the reply keeps the model name the caller asked for, as an alias's does."""
        try:
            return await self._chat(principal, req, protocol=protocol, action=action)
        except BudgetExceeded as refused:
            if not refused.fallback_model or refused.fallback_model == req.model:
                raise
            fallback = refused.fallback_model
        sub = await self._chat(principal, msgspec.structs.replace(req, model=fallback),
                               protocol=protocol, action=action)
        sub.own_headers[FALLBACK_HEADER] = fallback
        return sub

    async def _chat(self, principal: Principal, req: CallRequest, *, protocol: str,
                    action: str) -> Submitted:
        check(req)
        target = await self._model(principal, req.model, Kind.CHAT)
        return await guarded(self, principal, req, lambda checked, resumable: self._chat_on(
            principal, checked, target, protocol=protocol, action=action,
            resumable=resumable))

    async def _chat_on(self, principal: Principal, req: CallRequest,
                       target: DeploymentSpec | Route, *, protocol: str, action: str,
                       resumable: bool = True) -> Submitted:
        """`req` (checked, through its pre rules) admitted and queued on `target`."""
        if isinstance(target, DeploymentSpec):  # before the request becomes a prompt
            refuse_unfitting([m["content"] for m in req.messages], target)
        n, conversation_id = req.n, req.conversation_id
        choices.check(n, idempotency_key=req.idempotency_key, conversation_id=conversation_id)
        history = cast(list[Message], await async_db(conversation_history)(
            actor=principal, public_id=conversation_id) if conversation_id else [])
        if req.earlier:
            history = [*history, *(cast(Message, rendered(m)) for m in req.earlier)]
        droppable, scope = [m["content"] for m in history], await cache_scope(principal)
        prompt = prompt_of(req)
        affinity = affinity_key(principal.tenant_slug, prompt.messages, history)
        key, fingerprint = replay.idempotency(principal, req)

        async def on(spec: DeploymentSpec, routed: Routed | None = None) -> Submitted:
            """The call on deployment `spec` (an alias call's attempt: `routed`)."""
            # An upstream server gets the caller's messages and its tools natively (the
            # tool prompt is for Sluice's own models).
            messages = req.messages if spec.runtime == RuntimeName.OPENAI_UPSTREAM \
                else prompt.messages
            texts = [m["content"] for m in messages]
            if routed is not None:  # a direct call's was refused before its prompt
                refuse_unfitting(texts, spec)
            clamps = spec.max_tokens_policy == MaxTokensPolicy.CLAMP or \
                (routed is not None and routed.clamps)
            fitted, clamped = max_tokens_policy.fit(req.max_output_tokens, spec, texts,
                                                    clamps=clamps)
            max_tokens = fitted or min(default_max_tokens(spec.max_context),
                                       spec.max_output_tokens or spec.max_context)
            # One admission for every choice: one request, n times the tokens.
            admission = await self._admit(
                principal, spec, action, protocol, prompt.structure, messages,
                tokens=n * (prompt_bound(texts + droppable, spec) + max_tokens),
                routed=routed)
            if admission.max_tokens_cap is not None:
                max_tokens = min(max_tokens, admission.max_tokens_cap)
            if clamped:
                admission.headers[max_tokens_policy.CLAMPED_HEADER] = str(max_tokens)
            # After another deployment's reply was cut: its continuation (routed.py).
            resume = routed.resume if routed else None
            job = chat_job(req, prompt, messages, history=history, max_tokens=max_tokens,
                           resume=resume, cache_scope=scope)
            if routed is not None:
                await routed.supersede(key)
            handle, *more = await self._submit(
                principal, spec, choices.jobs(job, n), admission,
                timeout_s=routed.left_s() if routed is not None else req.timeout_s,
                # A continuation's stream holds only the reply's end: no replay of it.
                idempotency_key=key if resume is None else None,
                fingerprint=fingerprint,
                owner=replay.ownership(principal, req.model, conversation_id)
                if req.stream and n == 1 and resumable else None, affinity=affinity)
            return Submitted(principal, spec, handle, admission, conversation_id,
                             prompt.turn, more, routed=routed, idempotency_key=key)

        if isinstance(target, DeploymentSpec):
            return await on(target)
        return await self._routed(
            target, Kind.CHAT, on, texts=[m["content"] for m in prompt.messages],
            droppable=droppable, max_tokens=req.max_output_tokens, timeout_s=req.timeout_s,
            prompt_only=req.raw_prompt, affinity=affinity)

    async def count(self, principal: Principal, req: CallRequest, *,
                    action: str, protocol: str = "rest") -> Submitted:
        """Admit and enqueue a count of `req`'s prompt as the worker tokenizes it (the
        messages `chat` would send, tool prompt included; nothing generated): its final
        event's usage has the count. Admitted as a call (role, model access, limits,
        shedding) and settled without charge."""
        check(req)
        target = await self._model(principal, req.model, Kind.CHAT)
        if isinstance(target, DeploymentSpec):
            refuse_unfitting([m["content"] for m in req.messages], target)
        prompt = prompt_of(req)

        async def on(spec: DeploymentSpec, routed: Routed | None = None) -> Submitted:
            if routed is not None:
                refuse_unfitting([m["content"] for m in prompt.messages], spec)
            admission = await self._admit(principal, spec, action, protocol,
                                          prompt.structure, prompt.messages, tokens=0,
                                          routed=routed)
            # max_tokens 1: a worker that predates count_only still reports the exact
            # prompt count, after generating a single token.
            [handle] = await self._submit(
                principal, spec, [chat_job(req, prompt, prompt.messages, history=[],
                                           max_tokens=1, count_only=True)], admission,
                timeout_s=routed.left_s() if routed is not None else None)
            return Submitted(principal, spec, handle, admission, charge=False, routed=routed)

        if isinstance(target, DeploymentSpec):
            return await on(target)
        return await self._routed(target, Kind.CHAT, on, texts=[], max_tokens=None,
                                  timeout_s=None)

    async def _admit(self, principal: Principal, spec: DeploymentSpec, action: str,
                     protocol: str, structure: ChatJob, messages: list[Message], *,
                     tokens: int, routed: Routed | None = None) -> Admission:
        """The call admitted (limits, quotas, shedding, breaker), then its grammar
        (`structure`'s) compiled: a caller's schema costs nothing before its call is
        admitted, and a refused one is a refused call (its admission released)."""
        admission = await self.governor.admit(principal, spec, tokens=tokens)
        try:
            await check_grammar(structure, checker=self.grammars,
                                tenant=principal.tenant_slug)
        except BaseException:
            await admission.release()
            raise
        if routed is not None:
            admission = routed.admission(admission)
        admission.action, admission.protocol = action, protocol
        admission.request_text = next((m["content"] for m in reversed(messages)
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
        target = await self._model(principal, req.model, Kind.EMBEDDING)
        if req.dimensions is not None:
            raise BadRequest("This model does not support choosing dimensions.",
                             param="dimensions")
        inputs = [req.input] if isinstance(req.input, str) else req.input
        if any(not text for text in inputs):
            raise BadRequest("input must not contain empty strings.", param="input")
        guarding = await Guarding.of(self, principal, req.model)
        if guarding is not None:
            inputs = await guarding.inputs(inputs)
        return await self._vectors(principal, target, Kind.EMBEDDING, inputs,
                                   action="embeddings", protocol=protocol, timeout_s=timeout_s,
                                   notes=guarding.audit() if guarding is not None else None)

    async def classify(self, principal: Principal, model: str, inputs: list[str], *,
                       action: str = "moderations", protocol: str = "rest",
                       timeout_s: float | None = None, chosen: bool = False) -> Submitted:
        """A classifier deployment's probabilities for `inputs` (one event of vectors,
        with their labels). `chosen`: a policy chose the model (a classifier guard), not
        the caller, so neither the caller's role nor its key's model allow-list is asked
        (the call is still admitted: limits, quotas, breaker, shedding)."""
        target = await (self._chosen(model, Kind.CLASSIFY) if chosen
                        else self._model(principal, model, Kind.CLASSIFY))
        return await self._vectors(principal, target, Kind.CLASSIFY, inputs, action=action,
                                   protocol=protocol, timeout_s=timeout_s)

    async def judge(self, principal: Principal, req: CallRequest) -> Submitted:
        """A chat call a policy makes (an LLM judge guard), as the caller's: the policy
        chose the model, so neither the caller's role nor its key's allow-list is asked,
        and no guardrail runs on it (a judge is not judged)."""
        check(req)
        return await self._chat_on(principal, req, await self._chosen(req.model, Kind.CHAT),
                                   protocol="guard", action="guardrails.judge",
                                   resumable=False)

    async def _chosen(self, name: str, kind: Kind) -> DeploymentSpec | Route:
        """The enabled deployment (or alias) of `kind` a policy names."""
        spec = await enabled_spec(name)
        target = spec if spec is not None else await alias_route(name)
        if target is None or (spec is not None and spec.kind != kind):
            raise NotFound(f"The {kind.value} model '{name}' a policy names is not enabled.",
                           code="model_not_found", param="model")
        return target

    async def _vectors(self, principal: Principal, target: DeploymentSpec | Route,
                       kind: Kind, inputs: list[str], *, action: str, protocol: str,
                       timeout_s: float | None,
                       notes: dict[str, Any] | None = None) -> Submitted:
        """An embedding or classification call of `inputs` on `target`, admitted."""
        async def on(spec: DeploymentSpec, routed: Routed | None = None) -> Submitted:
            admission = await self.governor.admit(
                principal, spec, tokens=sum(prompt_bound([t], spec) for t in inputs))
            if routed is not None:
                admission = routed.admission(admission)
            admission.action, admission.protocol = action, protocol
            admission.request_text = inputs[0]
            admission.notes.update(notes or {})
            [handle] = await self._submit(
                principal, spec, [EmbedJob(input=inputs)], admission,
                timeout_s=routed.left_s() if routed is not None else timeout_s)
            return Submitted(principal, spec, handle, admission, routed=routed)

        if isinstance(target, DeploymentSpec):
            return await on(target)
        # Not routed by context: an encoder truncates its inputs to its own.
        return await self._routed(target, kind, on, texts=[], max_tokens=None,
                                  timeout_s=timeout_s)


_shared: Gateway | None = None


def shared_gateway() -> Gateway:
    """The process's gateway, shared by the lean HTTP app and the WebSocket consumers
    (one Redis client and one governance recorder per event loop)."""
    global _shared
    if _shared is None:
        _shared = Gateway()
    return _shared

