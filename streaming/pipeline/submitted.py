"""An admitted call: its queued requests, its admission, and what settles it as its
events end (quota, breaker, audit event, metrics, the wait span). A call to a model
alias asks its route (streaming/pipeline/routed.py Routed.fall_back, which moves the route's own
state) for the next deployment's attempt when its request fails retriably: before any
text afresh, after text as a continuation of what was sent (the caller's events go on
in sequence, nothing repeated); the failed attempt is settled on its own, the call goes
on with the next attempt's request and admission."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from opentelemetry.trace import Status, StatusCode
from redis.exceptions import RedisError

from governance import pricing
from governance.admission import Admission
from inference.client import RequestHandle
from inference.jobs import (
    DeltaEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    is_delta,
    is_done,
    is_error,
    is_final,
)
from inference.spec import DeploymentSpec
from sluice.observability import metrics, telemetry
from streaming.pipeline import choices, replay
from streaming.pipeline.routed import Routed, retriable_failure
from tenants.principal import Principal

if TYPE_CHECKING:
    from streaming.pipeline.guarding import Guarding


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
    routed: Routed | None = None  # a call to a model alias: its route
    idempotency_key: str | None = None  # as the queue stores it (streaming/pipeline/replay.py)
    # Runs the call afresh (set by Call for a call answered in one piece): what a replay
    # whose request was cancelled does instead of answering with the cut reply.
    again: Callable[[], Awaitable[Submitted]] | None = None
    # The request's trace context and start, for the wait span and time to first token.
    trace_context: Any = field(default_factory=telemetry.current_context)
    began: float = field(default_factory=lambda: _began())
    # Response headers the codec's call adds (streaming/pipeline/call.py Call.note).
    own_headers: dict[str, str] = field(default_factory=dict)
    # The final event it settles with, once its events ended (every choice's, combined).
    final: FinalEvent | None = None
    # Its guardrails' during and post rules (None: no policy covers the call).
    guarding: Guarding | None = None

    @property
    def headers(self) -> dict[str, str]:
        """Response headers the pipeline adds (x-ratelimit-*, degradation notes) and the
        call's own; once its events ended as a reply, with a price at its admission,
        what it cost (COST_HEADER, US dollars)."""
        headers = {**self.admission.headers, **self.own_headers}
        if self.final is not None and is_done(self.final):
            cost = self.admission.cost(self.final)
            if cost is not None:
                headers[pricing.COST_HEADER] = pricing.usd(cost)
        return headers

    @property
    def handles(self) -> list[RequestHandle]:
        return [self.handle, *self.more]

    @property
    def charged(self) -> bool:
        """Whether the events are this call's own run, which its metrics observe (not
        an idempotent replay: the replay's settlement charges the request only if the
        gateway that ran it did not, Governor.settle)."""
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

    def events(self) -> AsyncGenerator[Event]:
        """The call's events (through its guardrails' during and post rules, when it
        has any: streaming/pipeline/guarding.py); see `_events`."""
        if self.guarding is None:
            return self._events()
        return self.guarding.events(self, self._events())

    async def _events(self) -> AsyncGenerator[Event]:
        """The call's events as the worker sent them; settles its admission when they
        end (or, when the consumer stops early, once the worker's final events arrive).
        With n > 1 choices: every choice's events as they arrive, each tagged with its
        index (`"i"`; absent means 0), ending after the last choice's final event
        (streaming/pipeline/choices.py)."""
        finals: list[FinalEvent] = []
        self.read = True
        self.admission.request_id = self.handle.rid
        # Not the current span: a generator's consumer may resume it in another context.
        span = telemetry.child_span("sluice.wait", self.trace_context,
                                    {"sluice.request_id": self.handle.rid})
        first: float | None = None
        merged = choices.merged(self.handles) if self.more else None
        # A routed call's reply so far: what a continuation on its next deployment
        # resumes after (routed.py).
        sent = _Sent() if self.routed is not None and merged is None else None
        try:
            while True:
                retried = False
                # A replay answered in one piece: its events are held until its end shows
                # whether its request ran to the end (else the call runs afresh).
                held: list[Event] | None = [] if self._whole_replay() else None
                # (RequestHandle.events is an async generator: closed on leaving early.)
                events = merged or cast(AsyncGenerator[Event], self.handle.events())
                async with contextlib.aclosing(events):
                    async for event in events:
                        if is_final(event):
                            if is_error(event) and sent is not None \
                                    and await self._fall_back(event, sent):
                                retried = True
                                break
                            finals.append(event)
                            if self.handle.replayed and _cancelled(event):
                                if held is not None and await self._afresh(event):
                                    finals.pop()
                                    retried = True
                                    break
                                await self._free_key()
                                event = cancelled_error(event)
                        elif held is not None:
                            held.append(event)
                            continue
                        for out in [*(held or ()), event]:
                            if is_delta(out):
                                if sent is not None:
                                    sent.add(out)
                                if first is None:
                                    first = time.perf_counter()
                                    span.add_event("first_token")
                                if merged is None or out["i"] == 0:  # the audit's: choice 0
                                    self.admission.note_reply(out.get("text", ""))
                            yield out
                if not retried:
                    break
        except BaseException as exc:
            if merged is not None:
                await merged.aclose()  # its readers of the n requests stop now
                choices.settle_later(self.admission, self.handles, finals, exc)
            else:
                self.admission.governor.finish_later(
                    self.admission, finals[0] if finals else None, exc, self.handle.rid,
                    self.handle.deadline_ms, charge=self.charge, replay=self.handle.replayed)
            self._observed(span, choices.combined(finals), first, exc)
            raise
        # Settlement, the audit event and the metrics (~0.15 ms of CPU, nothing awaited)
        # run at the loop's next turn: by then the adapter has written the reply, which
        # no longer waits for them. Their durations end here, not when they run.
        self.final = choices.combined(finals)
        asyncio.get_running_loop().call_soon(
            self._settle, span, self.final, first,
            (time.perf_counter(), time.time_ns()), time.monotonic())

    def _whole_replay(self) -> bool:
        return self.handle.replayed and self.again is not None and not self.more

    async def _free_key(self, *, unended: bool = False) -> None:
        """Free the call's idempotency key while it names this request (`unended`: and
        the request has not ended): a retry with it runs afresh (the request was, or is
        being, cancelled; its reply is not a whole one)."""
        if self.idempotency_key is not None:
            with contextlib.suppress(RedisError):
                await replay.free_key(self.handle.client.redis, self.handle.tenant,
                                      self.idempotency_key, self.handle.rid, unended=unended)

    async def abandon(self) -> None:
        """Stop the call because its caller left: its idempotency key is freed first
        (unless the request has just ended whole), then every choice is cancelled, so a
        retry with the key runs afresh rather than replay a cut reply."""
        await self._free_key(unended=True)
        await self.cancel()

    async def _afresh(self, cancelled: FinalEvent) -> bool:
        """This replay's request was cancelled (its first client left) and nothing was
        sent: free the key and go on with the call run afresh (`again`); this attempt's
        admission is released. False when it cannot run again (the `cancelled` event is
        then the answer, reported as an error)."""
        again, self.again = self.again, None  # once: a second cut answer is reported
        if again is None:
            return False
        await self._free_key()
        self.admission.finish_now(None, charge=False, audited=False)
        fresh = await again()
        self._switch_to(fresh)
        self.idempotency_key = fresh.idempotency_key
        return True

    async def _fall_back(self, failed: ErrorEvent, sent: _Sent) -> bool:
        """After this attempt's request failed with `failed`: when the failure is
        retriable and the route gives a next attempt (Routed.fall_back: admitted within
        the deadline; after text was `sent`, as its continuation, never after a tool
        call's pieces), settle this attempt (not audited: the call's audit event lists
        it) and go on with the next one's request. False: `failed` is the answer."""
        routed = self.routed
        if routed is None or self.handle.replayed or not retriable_failure(failed) \
                or sent.tools:
            return False
        attempt = await routed.fall_back(failed, deployment=self.spec.name,
                                         handle=self.handle, text="".join(sent.text),
                                         deltas=sent.deltas, next_seq=sent.next_seq)
        if attempt is None:
            return False
        if sent.deltas:
            attempt.handle.next_seq = sent.next_seq  # its events go on from there
            for text in self.admission.reply:  # the audit's excerpt: the whole reply
                attempt.admission.note_reply(text)
        self.admission.finish_now(failed, charge=self.charge, audited=False)
        self._switch_to(attempt)
        return True

    def _switch_to(self, other: Submitted) -> None:
        """Go on with `other`'s request and admission (a fallback's or a fresh run's)."""
        notes = self.admission.notes
        self.spec, self.handle, self.admission = other.spec, other.handle, other.admission
        self.admission.request_id = self.handle.rid
        self.admission.notes.update(notes)  # the call's, whichever attempt answers

    def _settle(self, span: Any, final: FinalEvent | None, first: float | None,
                ended: tuple[float, int], ended_monotonic: float) -> None:
        try:
            self._observed(span, final, first, None, ended)
        finally:
            self.admission.finish_now(final, charge=self.charge, ended=ended_monotonic,
                                      replay=self.handle.replayed)

    def _observed(self, span: Any, final: FinalEvent | None, first: float | None,
                  error: BaseException | None,
                  ended: tuple[float, int] | None = None) -> None:
        """End the wait span; time to first token and decode rate go to the metrics
        (`ended`: when the events ended, as perf_counter() and time_ns(); default now)."""
        prompt, completion = ((final["usage"]["prompt_tokens"],
                               final["usage"]["completion_tokens"]) if final is not None
                              else (0, 0))
        finish = final["finish"] if final is not None and is_done(final) else ""
        failed = final["code"] if final is not None and is_error(final) else None
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


@dataclass
class _Sent:
    """What a routed call's caller already got of the reply: its delta events' text,
    how many, the sequence number the next one takes, whether any carried tool-call
    pieces (a call cut mid-arguments is not continued)."""

    text: list[str] = field(default_factory=list)
    deltas: int = 0
    next_seq: int = 0
    tools: bool = False

    def add(self, delta: DeltaEvent) -> None:
        self.text.append(delta["text"])
        self.deltas += 1
        self.next_seq = delta["seq"] + 1
        self.tools = self.tools or bool(delta.get("tools"))


def _cancelled(event: FinalEvent) -> bool:
    return is_done(event) and event["finish"] == "cancelled"


def cancelled_error(final: FinalEvent) -> ErrorEvent:
    """What a caller gets for a request that was cancelled (its first client left): a
    retriable error, never the cut reply as if it were whole."""
    return {"t": "error", "seq": final["seq"], "status": 503, "code": "request_cancelled",
            "message": "The request was cancelled before it finished (its client went "
                       "away); send it again to run it afresh (its Idempotency-Key too).",
            "usage": final["usage"], "retry": True}


def _began() -> float:
    scope = telemetry.current_scope()
    return scope.began if scope is not None else time.perf_counter()
