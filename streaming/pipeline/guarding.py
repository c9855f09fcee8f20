"""Guardrails as a stage of the call: one implementation for every API and transport.

The gateway's chat call runs its admission through `guarded` (gateway.py `_chat`).
`Guarding.of(gateway, principal, model)` is None for a call no policy covers (one
cached lookup: the call costs nothing more). Otherwise:
- `pre(req)`: before admission. The request's texts (each message's text, the tool-
  call arguments of earlier turns, each tool's name and description) go through the
  `pre` rules; a block is ContentBlocked (400 `content_blocked`, before any quota,
  token or queue is spent), a mask rewrites the request;
- `start_during(req)`: the `during` rules start beside the queued call;
- `events(sub, events)` (Submitted.events): the first event waits for the `during`
  verdicts (a block cancels the call and is its 400), then the reply goes through the
  `post` rules per choice (governance/guardrails/holdback.py), and a block stops that
  choice: cancelled on the worker, ended with finish `content_filter`. Under post
  rules a stream's tool-call pieces are held to the choice's end, whose tool calls'
  arguments are checked whole (the codecs then send each call whole).
An embeddings call's inputs go through the `pre` and then the `during` rules, both
before admission (there is no reply to check, and nothing to run beside).

Verdicts join the call's audit event (`detail.guardrails`) and metrics (runner.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

import msgspec
from django.conf import settings

from governance.cache import tenant_policies
from governance.guardrails.guards import Context
from governance.guardrails.holdback import Held
from governance.guardrails.judge import VERDICT_SCHEMA
from governance.guardrails.policy import Applied
from governance.guardrails.runner import Blocked, Verdicts, run
from inference.jobs import Event, Message, ResponseFormat, ToolSpec, is_delta, is_done
from sluice.errors import BadRequest, ContentBlocked
from streaming.pipeline.callrequest import CallRequest
from streaming.pipeline.fold import Fold
from tenants.principal import Principal

if TYPE_CHECKING:
    from streaming.pipeline.gateway import Gateway
    from streaming.pipeline.submitted import Submitted


class Guarding:
    def __init__(self, rules: Applied, ctx: Context) -> None:
        self.rules, self.ctx = rules, ctx
        self.verdicts = Verdicts()
        self._during: asyncio.Task[list[str]] | None = None
        self.stream = True
        # post rules that change what is sent (shadow and flag ones only watch)
        self.rewrites = any(not r.policy.shadow and r.policy.action != "flag"
                            for r in rules.post)

    @classmethod
    async def of(cls, gateway: Gateway, principal: Principal, model: str
                 ) -> Guarding | None:
        rules = (await tenant_policies(principal.tenant_id)).guardrails_for(
            key_id=principal.key_id, model=model)
        if not rules:
            return None

        async def classify(deployment: str, texts: list[str]
                           ) -> tuple[list[list[float]], list[str]]:
            """A classifier guard's call: the caller's, on the policy's model."""
            sub = await gateway.classify(principal, deployment, texts, chosen=True,
                                         action="guardrails.classify", protocol="guard")
            whole = await Fold(sub.events()).whole()
            return whole.vectors, whole.labels

        async def judge(deployment: str, instructions: str, text: str, max_tokens: int
                        ) -> tuple[bool, str]:
            """A judge guard's call: the caller's, on the policy's model, answered under
            the verdict's JSON schema."""
            req = CallRequest(
                model=deployment, max_output_tokens=max_tokens, temperature=0.0,
                messages=[{"role": "system", "content": instructions},
                          {"role": "user", "content": text}],
                response_format=ResponseFormat(schema=VERDICT_SCHEMA, strict=True))
            whole = await Fold((await gateway.judge(principal, req)).events()).whole()
            answer = json.loads(whole.text)  # a cut reply does not parse: an error
            return bool(answer["allowed"]), str(answer["category"])[:32]

        return cls(rules, Context(tenant=principal.tenant_slug,
                                  key_prefix=principal.key_prefix or "", model=model,
                                  phase="pre", classify=classify, judge=judge))

    def audit(self) -> dict[str, Any]:
        return {"guardrails": self.verdicts.summary()} if self.verdicts else {}

    def _blocked(self, blocked: Blocked) -> ContentBlocked:
        return ContentBlocked(blocked.policy.name, audit=self.audit())

    async def pre(self, req: CallRequest) -> CallRequest:
        """`req` after the pre rules (masked), or ContentBlocked."""
        self.stream = req.stream
        if self.rewrites and (req.logprobs or req.top_logprobs):
            # A token's log-probability entry carries its text: it cannot be held back
            # and masked like the reply's text.
            raise BadRequest("logprobs cannot be asked for on a model whose replies a "
                             "guardrail policy masks or blocks.", param="logprobs",
                             code="logprobs_guarded")
        if not self.rules.pre:
            return req
        texts = _texts(req)
        try:
            checked = await run(self.rules.pre, texts, self.ctx, self.verdicts)
        except Blocked as blocked:
            raise self._blocked(blocked) from None
        return req if checked == texts else _with_texts(req, checked)

    async def inputs(self, inputs: list[str]) -> list[str]:
        """An embeddings call's inputs after the pre and during rules."""
        try:
            inputs = await run(self.rules.pre, inputs, self.ctx, self.verdicts)
            return await run(self.rules.during, inputs, self.ctx._replace(phase="during"),
                             self.verdicts)
        except Blocked as blocked:
            raise self._blocked(blocked) from None

    def start_during(self, req: CallRequest) -> None:
        if self.rules.during:
            ctx = self.ctx._replace(phase="during")
            self._during = asyncio.create_task(
                run(self.rules.during, _texts(req), ctx, self.verdicts))

    def cancel(self) -> None:
        """The call's during checks are not needed (it was not admitted, or its reader
        left before their verdict); a no-op once they ended."""
        if self._during is not None and not self._during.done():
            self._during.cancel()

    async def events(self, sub: Submitted, events: AsyncGenerator[Event]
                     ) -> AsyncGenerator[Event]:
        """`events` under the during and post rules (see the module's docstring)."""
        async with contextlib.aclosing(events):
            try:
                if self._during is not None:
                    await self._during
            except Blocked as blocked:
                sub.admission.notes.update(self.audit())
                await sub.cancel()
                raise self._blocked(blocked) from None
            finally:  # the reader left first: its checks are not needed
                self.cancel()
            sub.admission.notes.update(self.audit())
            if not self.rules.post:
                async for passed in events:
                    yield passed
                return
            async for out in self._post(sub, events):
                yield out

    async def _post(self, sub: Submitted, events: AsyncGenerator[Event]
                    ) -> AsyncGenerator[Event]:
        ctx = self.ctx._replace(phase="post", request_id=sub.handle.rid)
        window = int(settings.SLUICE_GUARD_HOLDBACK_CHARS)
        held: dict[int, Held] = {}
        stopped: set[int] = set()
        raw: Event
        async for raw in events:
            delta = is_delta(raw)
            if not delta and not is_done(raw):
                yield raw
                continue
            event: dict[str, Any] = cast(dict[str, Any], raw)  # rewritten by key
            i = event.get("i", 0)
            if i in stopped:
                if not delta:
                    yield _filtered(event)
                continue
            h = held.get(i)
            if h is None:
                h = held[i] = Held(self.rules.post, ctx, self.verdicts, window=window,
                                   stream=self.stream)
            try:
                if delta:
                    out = await h.feed(event["text"])
                    if self.rewrites and "tools" in event:
                        event = {k: v for k, v in event.items() if k != "tools"}
                    yield cast(Event, {**event, "text": out})
                    continue
                rest = await h.end()
                done = await self._tool_calls(event, ctx)
            except Blocked:
                stopped.add(i)
                sub.admission.notes.update(self.audit())
                if not delta:
                    yield _filtered(event)
                else:
                    await sub.handles[i].cancel()
                continue
            sub.admission.notes.update(self.audit())
            if rest:
                yield cast(Event, {"t": "delta", "seq": event["seq"], "text": rest,
                                   "ids": [], **({"i": i} if "i" in event else {})})
            yield done

    async def _tool_calls(self, done: dict[str, Any], ctx: Context) -> Event:
        """A final event with its tool calls' arguments through the post rules."""
        calls = done.get("tool_calls")
        if not calls:
            return cast(Event, done)
        texts = [c["arguments"] for c in calls]
        checked = await run(self.rules.post, texts, ctx, self.verdicts)
        if checked == texts:
            return cast(Event, done)
        return cast(Event, {**done, "tool_calls": [
            {**c, "arguments": a} for c, a in zip(calls, checked, strict=True)]})


async def guarded(gateway: Gateway, principal: Principal, req: CallRequest,
                  admit: Callable[[CallRequest, bool], Awaitable[Submitted]]) -> Submitted:
    """`admit(req, resumable)` (the gateway's admission and submission) under the
    call's guardrails: `req` after its pre rules, its during rules started beside it,
    its events through its post rules; as it is when no policy covers the call. A reply
    the post rules rewrite is neither kept raw by the worker nor resumable."""
    guarding = await Guarding.of(gateway, principal, req.model)
    if guarding is None:
        return await admit(req, True)
    req = await guarding.pre(req)
    if guarding.rewrites:  # stored as sent (the gateway stores it; the worker would not)
        req = msgspec.structs.replace(req, keep=None)
    guarding.start_during(req)
    try:
        sub = await admit(req, not guarding.rewrites)
    except BaseException:
        guarding.cancel()
        raise
    sub.guarding = guarding
    sub.admission.notes.update(guarding.audit())
    return sub


def _filtered(done: dict[str, Any]) -> Event:
    """A stopped choice's final event: finish `content_filter`, no tool calls; its
    usage (what was generated, and billed) kept."""
    return cast(Event, {**done, "t": "done", "finish": "content_filter", "tool_calls": []})


def _texts(req: CallRequest) -> list[str]:
    """What the pre rules read of a request, in a fixed order: each message's text,
    then each earlier tool call's arguments, then each tool's name and description."""
    texts = [m["content"] for m in req.messages]
    texts += [c["function"]["arguments"] for m in req.messages
              for c in m.get("tool_calls", ())]
    texts += [f"{t.name}: {t.description}" if t.description else t.name for t in req.tools]
    return texts


def _with_texts(req: CallRequest, texts: list[str]) -> CallRequest:
    """`req` with the texts `_texts` read replaced (in the same order)."""
    it = iter(texts)
    messages: list[Message] = [{**m, "content": next(it)} for m in req.messages]
    for m in messages:
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": next(it)}}
                               for c in m["tool_calls"]]
    tools: list[ToolSpec] = []
    for tool, text in zip(req.tools, it, strict=False):
        description = text.split(": ", 1)[1] if tool.description and ": " in text \
            else tool.description
        tools.append(msgspec.structs.replace(tool, description=description))
    return msgspec.structs.replace(req, messages=messages, tools=tools)
