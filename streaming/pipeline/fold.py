"""One fold over a call's events: outside inference/, the only reader of their tags.

A worker's events are tagged dicts (inference/jobs.py says why they stay dicts on the
hot path). Every codec and transport reads them through a `Fold`, which makes each
event into typed pieces, in order:

- `Delta(i, seq, text, lp, tools)`: what choice `i` wrote next: its text (possibly ""
  when only log-probability entries or tool-call pieces came), the tokens' log-
  probability entries (`lp`, None when the job did not ask for them) and pieces of the
  tool calls it is writing (`tools`, None when it wrote none). A delta that holds its
  text back (a stop string's start) and has neither makes no piece;
- `Final(i, seq, event)`: choice `i` ended; `event["finish"]` says why (stop, length,
  tool_calls, cancelled), its tool calls whole, its usage;
- `Failure(i, seq, error)`: choice `i` failed; `error` the ApiError to send or raise;
- `Vectors(i, seq, data, labels)`: an embeddings call's vectors (a classifier's
  probabilities, with the labels they are of).

`seq` is the event's own (an SSE event id is `<rid>:<seq>`); `i` is 0 unless the call
has several choices. The fold keeps what encoders need across pieces: each choice's
final event (`finals`, done or failed, in arrival order), their usage summed
(`usage()`), the prompt's count as the first event tells it (`prompt_tokens`).

    fold = Fold(sub.events(), n=sub.n)
    async with fold:                # leaving closes the events (Submitted.events)
        await fold.start()          # the first event: its error is raised
        async for piece in fold:
            if isinstance(piece, Delta): ...

A codec that streams starts with `start` (streaming/apis/sse.py does): an error before any
output is then a plain error reply; one after it is a `Failure` piece. Leaving the
block early (an error, the client gone) settles the call as one its consumer left.

A reply in one piece is `await fold.whole()` (every choice's text, log-probabilities
and final event; the first failure raised, a cancelled choice's cut reply the
retriable `request_cancelled`). Events already read (a kept reply's, stored as a list)
are `stored(events)`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from inference.jobs import DoneEvent, Event, FinalEvent, ToolDelta, Usage, summed
from sluice.errors import ApiError, ServerError
from streaming.pipeline.failures import error_from_event
from streaming.pipeline.submitted import cancelled_error

# Pieces are small slotted structs: one is made per token of every stream.


@dataclass(slots=True)
class Delta:
    i: int
    seq: int
    text: str
    lp: list[dict[str, Any]] | None
    tools: list[ToolDelta] | None


@dataclass(slots=True)
class Final:
    i: int
    seq: int
    event: DoneEvent


@dataclass(slots=True)
class Failure:
    i: int
    seq: int
    error: ApiError


@dataclass(slots=True)
class Vectors:
    i: int
    seq: int
    data: list[list[float]]
    labels: list[str] | None = None  # a classifier's, naming each vector's entries


Piece = Delta | Final | Failure | Vectors


@dataclass
class Whole:
    """A call's reply in one piece: per choice, its text, log-probability entries and
    final event (each whole: not cancelled); an embeddings call's vectors."""

    texts: list[str]
    lps: list[list[dict[str, Any]]]
    finals: list[DoneEvent]
    vectors: list[list[float]] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # a classifier's

    @property
    def text(self) -> str:
        return self.texts[0]

    @property
    def final(self) -> DoneEvent:
        return self.finals[0]

    def usage(self) -> Usage:
        return summed(self.finals)


class Fold:
    """A call's events (`n` choices) read once, as pieces; see the module's docstring."""

    def __init__(self, events: AsyncIterator[Event], n: int = 1) -> None:
        self._events = events
        self._first: Event | None = None
        self.n = n
        self.finals: list[FinalEvent] = []
        self.done = 0  # how many choices ended `done`
        self.prompt_tokens = 0  # as far as the first event tells it
        self.cached_tokens = 0  # of those, not computed (jobs.Usage)

    async def __aenter__(self) -> Fold:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        close = getattr(self._events, "aclose", None)
        if close is not None:
            await close()

    async def start(self) -> None:
        """Wait for the first event; raise its ApiError when it is an error (nothing of
        the call was output: it fails as a whole). `prompt_tokens` and `cached_tokens`
        are set from it."""
        first: Event = await anext(self._events)
        if first["t"] == "error":
            self._final(first)
            raise error_from_event(first)
        self._first = first
        if first["t"] == "delta":
            self.prompt_tokens = first.get("prompt_tokens", 0)
            self.cached_tokens = first.get("cached_tokens", 0)
        elif first["t"] == "done":
            self.prompt_tokens = first["usage"]["prompt_tokens"]
            self.cached_tokens = first["usage"].get("cached_tokens", 0)

    def __aiter__(self) -> Fold:
        return self

    async def __anext__(self) -> Piece:
        first = self._first
        if first is not None:
            self._first = None
            if (piece := self.read(first)) is not None:
                return piece
        async for event in self._events:
            if (piece := self.read(event)) is not None:
                return piece
        raise StopAsyncIteration

    def read(self, event: Event) -> Piece | None:
        """The piece of one event (None for a delta with nothing in it), noting a
        final one."""
        if event["t"] == "delta":
            lp, tools = event.get("lp"), event.get("tools")
            if event["text"] or lp or tools is not None:
                return Delta(event.get("i", 0), event["seq"], event["text"], lp, tools)
            return None
        if event["t"] == "done":
            self._final(event)
            return Final(event.get("i", 0), event["seq"], event)
        if event["t"] == "error":
            self._final(event)
            return Failure(event.get("i", 0), event["seq"], error_from_event(event))
        return Vectors(event.get("i", 0), event["seq"], event["data"], event.get("labels"))

    def _final(self, event: FinalEvent) -> None:
        self.finals.append(event)
        if event["t"] == "done":
            self.done += 1

    def usage(self) -> Usage:
        """The usage of the choices ended so far, summed."""
        return summed(self.finals)

    async def whole(self) -> Whole:
        """Every event to the call's end (of a fold not started), as one reply; the
        first failure is raised (its events closed first: with n > 1 the other choices
        are cancelled). The events are read to their end: leaving them at a final
        event would settle the call as one its consumer left (Submitted.events)."""
        texts: list[list[str]] = []
        lps: list[list[dict[str, Any]]] = []
        finals: list[DoneEvent | None] = []
        for _ in range(self.n):  # loops, not comprehensions: nearly every call has n = 1
            texts.append([])
            lps.append([])
            finals.append(None)
        vectors: list[list[float]] = []
        labels: list[str] = []
        read = self.read
        try:
            async for event in self._events:  # a fold not started: no first event held
                piece = read(event)
                if isinstance(piece, Delta):
                    texts[piece.i].append(piece.text)
                    if piece.lp:
                        lps[piece.i] += piece.lp
                elif isinstance(piece, Final):
                    finals[piece.i] = piece.event
                elif isinstance(piece, Failure):
                    raise piece.error
                elif isinstance(piece, Vectors):
                    vectors, labels = piece.data, piece.labels or []
        finally:
            await self.aclose()
        return Whole(["".join(t) for t in texts], lps, all_whole(finals), vectors, labels)


def stored(events: Iterable[Event]) -> list[Piece]:
    """The pieces of events already read, in order."""
    fold = Fold(_nothing())
    return [piece for event in events if (piece := fold.read(event)) is not None]


async def _nothing() -> AsyncIterator[Event]:
    return
    yield  # an async generator of no events


def all_whole(finals: list[DoneEvent | None]) -> list[DoneEvent]:
    """Every choice's final event (each choice ends with one, or the call raised), each
    `whole`."""
    done = [whole(final) for final in finals if final is not None]
    if len(done) != len(finals):
        raise ServerError("A choice ended without a final event.")
    return done


def whole(final: DoneEvent) -> DoneEvent:
    """`final`, when its reply is whole; a cancelled request's cut reply is the
    retriable error `request_cancelled` instead."""
    if final["finish"] == "cancelled":
        raise error_from_event(cancelled_error(final))
    return final
