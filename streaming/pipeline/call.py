"""One API call's life after authentication, owned once for every API and transport.

    async with Call(gateway, principal, action="chat.completions", protocol="rest",
                    params=PARAMS) as call:  # the API's names for neutral parameters
        sub = await call.chat(req)           # a CallRequest: admission and submission
        async with Fold(sub.events(), sub.n) as fold:  # the events as typed pieces
            async for piece in fold:         # (streaming/pipeline/fold.py)
                ...                          # the codec encodes them, nothing more
        await call.remember(text)            # the conversation's turn

The codecs (streaming/apis/*, the gRPC servicer, the WebSocket consumer, the Batch API)
parse a request into one CallRequest (streaming/pipeline/callrequest.py) and encode the call's
events; the block's exit does the rest, whatever the codec did:
- an error before admission (bad input, rights, limits, quotas, shedding) is audited as
  a refused call; Redis failing under the call becomes the retriable 503
  `queue_unavailable` (audited too);
- an admitted call settles itself as its events end (Submitted.events: quota, breaker,
  audit event, metrics), also when the codec stops reading early;
- leaving the block before every choice's final event (the client went away, the task
  was cancelled, the codec failed) stops the generation on the worker, billed what was
  made, and frees the call's idempotency key (a retry with it runs afresh: a cut reply
  is never replayed as the answer); except after `client_gone(resumable=True)` of a
  one-choice stream, which is cancelled only if no client resumes it within
  SLUICE_STREAM_RESUME_GRACE_S;
- a call answered in one piece whose idempotent retry finds the first request
  cancelled runs afresh (Submitted.again); a stream that replays one ends with the
  retriable error `request_cancelled`.
A resumed stream (`resume`) is no new call: its stored events are read again, for
whoever may read the original, and audited as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine
from types import TracebackType
from typing import TYPE_CHECKING, Any

from django.conf import settings
from redis.exceptions import RedisError

from governance import audit
from inference.jobs import Event
from sluice.errors import ApiError, ContentBlocked, NotFound
from sluice.observability import metrics, telemetry
from streaming.pipeline import replay
from streaming.pipeline.callrequest import NEUTRAL, CallRequest, Params
from streaming.pipeline.failures import queue_unavailable
from streaming.pipeline.fold import Fold
from streaming.pipeline.gateway import Gateway
from streaming.pipeline.schemas import EmbeddingRequest
from streaming.pipeline.submitted import Submitted
from tenants.principal import Principal

if TYPE_CHECKING:
    from streaming.apis.httpio import Receive

_background: set[asyncio.Task[None]] = set()  # cancellations after the block


class Call:
    """See the module docstring. `model` is what the refused call's audit names (set
    from the request as soon as it is parsed); `protocol` the audit's and metrics'
    transport name ("rest", "sse", "grpc", "websocket", "batch"); `params` the API's
    names for the call request's neutral parameters (streaming/pipeline/callrequest.py)."""

    def __init__(self, gateway: Gateway, principal: Principal, *, action: str,
                 protocol: str, began: float | None = None,
                 params: Params = NEUTRAL) -> None:
        self.gateway, self.principal, self.action = gateway, principal, action
        self.params = params
        self._protocol = protocol
        self.began = time.monotonic() if began is None else began
        self.model = ""
        self.subs: list[Submitted] = []  # admitted (a legacy completion: one a prompt)
        self._admitting = False
        self._left = False  # the client went away and its cancellation is decided
        self._notes: dict[str, Any] = {}
        self._headers: dict[str, str] = {}

    @property
    def protocol(self) -> str:
        return self._protocol

    @protocol.setter
    def protocol(self, value: str) -> None:
        """Also the served request's (its metrics' label)."""
        self._protocol = value
        scope = telemetry.current_scope()
        if scope is not None:
            scope.protocol = value

    @property
    def sub(self) -> Submitted:
        """The admitted call (the first, when there are several)."""
        return self.subs[0]

    async def __aenter__(self) -> Call:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        for sub in self.subs:
            if not sub.read:  # nobody will: cancel it and read it out (that settles it)
                _in_background(_drain(sub))
            elif not sub.ended and not self._left:
                with contextlib.suppress(Exception):  # it must not hide the call's error
                    await asyncio.shield(sub.abandon())
        refused = not self.subs or self._admitting
        if isinstance(exc, RedisError):
            error = queue_unavailable()
            if refused:
                self._refused(error)
            raise error from None
        if isinstance(exc, ApiError) and refused:
            self._refused(exc)

    def _refused(self, exc: ApiError) -> None:
        """Audit the call refused before admission (an admitted call is audited by its
        settlement). Not those refused because the audit log is not keeping up: each
        would add to what it cannot take. (Unauthenticated calls never get a Call:
        there is no tenant to file them under.)"""
        scope = telemetry.current_scope()
        metrics.observe_refusal(scope.model if scope is not None else "", exc.code)
        if exc.code == "audit_unavailable":
            return
        self.gateway.governor.recorder.audit(audit.call_event(
            principal=self.principal, action=self.action or "unknown",
            model=self.model[:100], protocol=self.protocol, status=exc.status,
            latency_ms=(time.monotonic() - self.began) * 1000,
            trace_id=telemetry.ids()[0],
            detail={"code": exc.code, "type": exc.type, **self._notes,
                    **(exc.audit if isinstance(exc, ContentBlocked) else {})}))

    def note(self, detail: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        """What the codec decided about the request, noted before admission: `detail`
        joins the call's audit event, admitted or refused (scalars: the audit keeps
        detail small); `headers` join an admitted call's reply (Submitted.headers)."""
        self._notes.update(detail)
        self._headers.update(headers or {})

    async def chat(self, req: CallRequest) -> Submitted:
        """Admit and submit a chat call (Gateway.chat). A call may admit several (a
        legacy completion's prompts); a refusal of any is the call's, naming its
        parameter as the call's API does (`params`)."""
        self.model = req.model

        def chat() -> Awaitable[Submitted]:
            return self.gateway.chat(self.principal, req, protocol=self.protocol,
                                     action=self.action)

        sub = await self._admit(chat())
        if sub.handle.replayed and not req.stream:
            sub.again = chat  # a replay of a cancelled request runs afresh (Submitted)
        return sub

    async def resume(self, rid: str, after: int, *, model: str,
                     conversation: str | None = None) -> AsyncIterator[Event]:
        """The stored events of an earlier stream (request `rid`; `model` the one it
        named) for a client that has those up to seq `after`: only for whoever may read
        the original (replay.authorize_resume; anyone else's is a NotFound), which re-
        attaches it (no cancellation at its resume grace's end); audited as
        `chat.completions.resume`. Nothing is regenerated or charged."""
        self.action = "chat.completions.resume"
        principal, client = self.principal, self.gateway.client
        tenant = principal.tenant_slug
        await replay.authorize_resume(principal, await client.owner_of(tenant, rid),
                                      model=model, conversation=conversation)
        if not await client.attach(tenant, rid):
            raise NotFound("No resumable stream with that Last-Event-ID.",
                           code="stream_not_found")
        self.gateway.governor.recorder.audit(replay.resume_event(
            principal, rid, model=model, after=after, protocol=self.protocol,
            began=self.began))
        return client.replay(tenant, rid, timeout_s=settings.SLUICE_REQUEST_TIMEOUT_S)

    async def embed(self, req: EmbeddingRequest, *, timeout_s: float | None = None
                    ) -> Submitted:
        self.model = req.model
        return await self._admit(self.gateway.embed(
            self.principal, req, protocol=self.protocol, timeout_s=timeout_s))

    async def classify(self, model: str, inputs: list[str]) -> Submitted:
        """A classifier's probabilities for `inputs` (Gateway.classify)."""
        self.model = model
        return await self._admit(self.gateway.classify(
            self.principal, model, inputs, action=self.action, protocol=self.protocol))

    async def _admit(self, admission: Awaitable[Submitted]) -> Submitted:
        self._admitting = True
        try:
            sub = await admission
        except ApiError as exc:
            raise self.params.named(exc) from None
        sub.admission.notes.update(self._notes)
        sub.own_headers.update(self._headers)
        self.subs.append(sub)
        self._admitting = False
        return sub

    async def count(self, req: CallRequest) -> int:
        """The prompt's tokens as the model's worker counts them (template and tool
        prompt included); admitted as a call, never charged."""
        self.model = req.model
        sub = await self._admit(self.gateway.count(self.principal, req, action=self.action,
                                                   protocol=self.protocol))
        final = (await Fold(sub.events()).whole()).final
        return final["usage"]["prompt_tokens"]

    async def remember(self, reply: str) -> None:
        """The call's turn (its messages and `reply`) into its conversation, if any."""
        await self.gateway.remember(self.sub, reply)

    def client_gone(self, *, resumable: bool) -> None:
        """The client went away. A resumable stream (one choice, streamed) stays alive
        for the resume grace: cancelled then unless a client re-attached; anything else
        is cancelled when the block exits."""
        if len(self.subs) != 1 or self._left or not resumable or self.sub.n > 1:
            return
        sub = self.sub
        self._left = True
        handle = sub.handle
        _in_background(self.gateway.client.cancel_unless_resumed(
            sub.spec.name, handle.tenant, handle.rid,
            float(settings.SLUICE_STREAM_RESUME_GRACE_S)))

    @contextlib.asynccontextmanager
    async def watching(self, receive: Receive, *, resumable: bool) -> AsyncIterator[None]:
        """While the block runs, an ASGI client's disconnect is `client_gone` (for a
        plain reply, the disconnect cancels the call at once: the codec's pending read
        of its events is cancelled with the task that waits on them)."""
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.client_gone(resumable=resumable)
            if not self._left:
                await asyncio.gather(*(sub.abandon() for sub in self.subs))

        watcher = asyncio.create_task(watch())
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher


async def _drain(sub: Submitted) -> None:
    """Cancel a call nobody reads and read its events to their end: that settles it
    (billed what was made)."""
    await sub.abandon()
    with contextlib.suppress(Exception):
        async for _event in sub.events():
            pass


def _in_background(work: Coroutine[Any, Any, None]) -> None:
    task = asyncio.create_task(work)
    _background.add(task)
    task.add_done_callback(_background.discard)
