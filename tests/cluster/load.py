"""The multi-node test's clients: chat calls through the official `openai` SDK, each with
an Idempotency-Key and a deadline, retried on a connection error against the other
gateway with the same key (as a client behind a load balancer would), and what each
call's attempts met.

A call ends answered (the echo of its prompt), refused by a status (what that status
was, and its Retry-After), or without either when every attempt until its deadline met
a connection error (`gave_up`: the client may send it again, with the same key).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import openai

RETRIABLE = {429, 503, 504}
# A stream's error event carries its error's type, not its status (sluice/errors.py).
EVENT_STATUS = {"rate_limit_error": 429, "service_unavailable": 503, "timeout_error": 504}
CONNECT_S = 2.0  # a cut node's SYNs go unanswered: give up on it quickly
BACKOFF_S = 0.2  # between two attempts that both failed to connect


def prompt(index: int) -> str:
    """The call's prompt; the echo model answers with it, so a reply names its call."""
    return f"call {index:05d} " + "abcdefghij" * 2


def index_of(excerpt: str) -> int | None:
    """The call index in an audited request excerpt (None for anything else)."""
    words = excerpt.split()
    if len(words) >= 2 and words[0] == "call" and words[1].isdigit():
        return int(words[1])
    return None


class CutStream(Exception):
    """A stream that ended without its final usage chunk."""


@dataclass
class Attempt:
    gateway: int
    started: float  # time.monotonic()
    ended: float
    kind: str  # "answered" | "status" (an HTTP error or an error event) | "connection"
    status: int | None = None  # an error event's: from its type (EVENT_STATUS)
    code: str | None = None
    retry_after: str | None = None
    error: str = ""
    event: bool = False  # an error event in a started stream (no headers, no Retry-After)

    @property
    def admitted(self) -> bool:
        """Passed admission (rate limits), as far as the client can tell."""
        return self.kind == "answered" or (
            self.kind == "status" and not (self.code or "").startswith("rate_limit"))


@dataclass
class Call:
    index: int
    tenant: str
    stream: bool
    first: int  # the gateway tried first
    pinned: bool = False  # a probe: its first gateway only, one attempt
    first_attempt_s: float | None = None  # an impatient client's first read timeout
    started: float = 0.0
    ended: float = 0.0
    attempts: list[Attempt] = field(default_factory=list)
    text: str | None = None
    rid: str | None = None
    tokens: int = 0
    completion_tokens: int = 0

    @property
    def key(self) -> str:
        return f"{self.tenant}-{self.index:05d}"

    @property
    def outcome(self) -> str:
        """answered | refused (a status) | gave_up (connection errors only) | bad."""
        if self.text is not None:
            return "answered" if self.text == prompt(self.index) else "bad"
        last = self.attempts[-1] if self.attempts else None
        if last is None or last.kind == "connection":
            return "gave_up"
        return "refused" if last.status in RETRIABLE else "bad"

    @property
    def retries(self) -> int:
        return max(0, len(self.attempts) - 1)


class Clients:
    """One SDK client per tenant and gateway; `send` runs one call to its end."""

    def __init__(self, bases: list[str], keys: dict[str, str], model: str, *,
                 deadline_s: float, attempt_s: float) -> None:
        self.model, self.deadline_s, self.attempt_s = model, deadline_s, attempt_s
        self.bases = bases
        self.sdk = {tenant: [openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key,
                                                max_retries=0) for base in bases]
                    for tenant, key in keys.items()}
        # Attempts waiting now, by tenant and gateway.
        self.in_flight = {(t, g): 0 for t in keys for g in range(len(bases))}

    async def close(self) -> None:
        for clients in self.sdk.values():
            for client in clients:
                await client.close()

    async def send(self, call: Call) -> Call:
        """Attempts until one is answered or refused, or the deadline passes; on a
        connection error the next attempt goes to the next gateway, same key."""
        call.started = time.monotonic()
        deadline = call.started + self.deadline_s
        gateway = call.first
        while (remaining := deadline - time.monotonic()) > 0:
            attempt = await self._attempt(call, gateway, remaining)
            call.attempts.append(attempt)
            if attempt.kind != "connection" or call.pinned:
                break
            if len(call.attempts) % len(self.bases) == 0:  # every gateway failed once
                await asyncio.sleep(min(BACKOFF_S, max(0.0, deadline - time.monotonic())))
            gateway = (gateway + 1) % len(self.bases)
        call.ended = time.monotonic()
        return call

    async def _attempt(self, call: Call, gateway: int, remaining: float) -> Attempt:
        client = self.sdk[call.tenant][gateway]
        began = time.monotonic()
        self.in_flight[call.tenant, gateway] += 1
        options: dict[str, Any] = {
            "model": self.model, "messages": [{"role": "user", "content": prompt(call.index)}],
            "extra_headers": {"Idempotency-Key": call.key},
            "timeout": openai.Timeout(
                call.first_attempt_s if call.first_attempt_s and not call.attempts
                else self.attempt_s, connect=CONNECT_S)}
        try:
            async with asyncio.timeout(remaining):
                if call.stream:
                    await self._streamed(call, client, options)
                else:
                    reply = await client.chat.completions.create(**options)
                    assert reply.usage is not None
                    call.text = reply.choices[0].message.content
                    call.rid = reply.id.removeprefix("chatcmpl-")
                    call.tokens = reply.usage.total_tokens
                    call.completion_tokens = reply.usage.completion_tokens
            return Attempt(gateway, began, time.monotonic(), "answered")
        except openai.APIStatusError as exc:
            body = exc.body if isinstance(exc.body, dict) else {}
            return Attempt(gateway, began, time.monotonic(), "status", exc.status_code,
                           body.get("code"), exc.response.headers.get("retry-after"))
        except (openai.APIConnectionError, CutStream, TimeoutError) as exc:
            return Attempt(gateway, began, time.monotonic(), "connection",
                           error=type(exc).__name__)
        except openai.APIError as exc:  # an error event in a stream that had started
            return Attempt(gateway, began, time.monotonic(), "status",
                           EVENT_STATUS.get(exc.type or "", 500), exc.code,
                           error=exc.message[:200], event=True)
        finally:
            self.in_flight[call.tenant, gateway] -= 1

    async def busy(self, tenant: str, gateway: int, calls: int, timeout: float) -> None:
        """Wait (up to `timeout`) until `calls` of `tenant`'s attempts are waiting on
        `gateway`, so that a fault there meets calls in flight."""
        deadline = time.monotonic() + timeout
        while self.in_flight[tenant, gateway] < calls and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _streamed(self, call: Call, client: openai.AsyncOpenAI,
                        options: dict[str, Any]) -> None:
        parts: list[str] = []
        rid = None
        usage = None
        stream = await client.chat.completions.create(
            **options, stream=True, stream_options={"include_usage": True})
        async with stream:
            async for chunk in stream:
                rid = chunk.id.removeprefix("chatcmpl-")
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
        if usage is None:  # ended without its usage chunk: a cut stream
            raise CutStream
        call.text, call.rid = "".join(parts), rid
        call.tokens, call.completion_tokens = usage.total_tokens, usage.completion_tokens


async def paced(clients: Clients, calls: list[Call], per_second: float) -> list[Call]:
    """Send `calls` open-loop, `per_second` of them each second, each to its end."""
    began = time.monotonic()

    async def one(n: int, call: Call) -> Call:
        await asyncio.sleep(max(0.0, began + n / per_second - time.monotonic()))
        return await clients.send(call)

    return list(await asyncio.gather(*(one(n, c) for n, c in enumerate(calls))))


@dataclass(frozen=True)
class RateFigures:
    admitted: int
    refused_by_limit: int
    span_s: float
    overshoot: float  # admitted beyond rate x span, over the whole run
    worst_window_overshoot: float  # the same over the worst window of `window_s`
    window_s: float


def rate_figures(calls: list[Call], per_minute: int, window_s: float = 10.0) -> RateFigures:
    """How many attempts the rate limit let through, against what a token bucket of
    `per_minute` allows: `rate x T` plus its burst over any interval T. An attempt
    counts in a window only when it began and ended inside it (it was admitted there),
    so the client's counts never exceed what the buckets admitted in that window."""
    attempts = [a for c in calls for a in c.attempts]
    admitted = sorted((a for a in attempts if a.admitted), key=lambda a: a.started)
    limited = sum(1 for a in attempts if (a.code or "").startswith("rate_limit"))
    rate = per_minute / 60
    if not admitted:
        return RateFigures(0, limited, 0.0, 0.0, 0.0, window_s)
    first = min(a.started for a in attempts)
    span = max(a.ended for a in admitted) - first
    worst = 0.0
    t = first
    while t + window_s <= first + span + 1:
        inside = sum(1 for a in admitted if a.started >= t and a.ended <= t + window_s)
        worst = max(worst, inside - rate * window_s)
        t += 0.5
    return RateFigures(len(admitted), limited, span, len(admitted) - rate * span, worst,
                       window_s)


def in_flight_at(calls: list[Call], gateway: int, moment: float) -> list[Call]:
    """The calls with an attempt on `gateway` under way at `moment`."""
    return [c for c in calls
            if any(a.gateway == gateway and a.started < moment < a.ended for a in c.attempts)]


def longest_gap(calls: list[Call], start: float, end: float) -> float:
    """The longest time between `start` and `end` with no call answered."""
    ends = sorted(c.ended for c in calls if c.outcome == "answered" and start <= c.ended <= end)
    marks = [start, *ends, end]
    return max(b - a for a, b in itertools.pairwise(marks))
