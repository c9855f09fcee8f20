"""The one fold over a call's events (streaming/pipeline/fold.py): the pieces each event makes,
what it keeps across them, and a reply in one piece."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from inference.jobs import DeltaEvent, DoneEvent, ErrorEvent, Event, ToolDelta
from sluice.errors import ApiError, Unavailable
from streaming.pipeline.fold import Delta, Failure, Final, Fold, Piece, Vectors, stored


def delta(seq: int, text: str, *, i: int | None = None,
          lp: list[dict[str, Any]] | None = None, tools: list[ToolDelta] | None = None,
          prompt_tokens: int | None = None) -> DeltaEvent:
    event: DeltaEvent = {"t": "delta", "seq": seq, "text": text, "ids": [seq]}
    if i is not None:
        event["i"] = i
    if lp is not None:
        event["lp"] = lp
    if tools is not None:
        event["tools"] = tools
    if prompt_tokens is not None:
        event["prompt_tokens"] = prompt_tokens
    return event


def done(seq: int, prompt: int = 3, completion: int = 2, i: int | None = None,
         finish: str = "stop") -> DoneEvent:
    event: DoneEvent = {"t": "done", "seq": seq, "finish": finish,
                        "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}
    if i is not None:
        event["i"] = i
    return event


def error(seq: int, status: int = 503, i: int | None = None) -> ErrorEvent:
    event: ErrorEvent = {"t": "error", "seq": seq, "status": status, "code": "model_error",
                         "message": "it failed",
                         "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    if i is not None:
        event["i"] = i
    return event


async def source(events: list[Event], closed: list[bool] | None = None
                 ) -> AsyncIterator[Event]:
    try:
        for event in events:
            yield event
    finally:
        if closed is not None:
            closed.append(True)


def pieces(events: list[Event], n: int = 1) -> list[Piece]:
    async def read() -> list[Piece]:
        async with Fold(source(events), n) as fold:
            await fold.start()
            return [piece async for piece in fold]
    return asyncio.run(read())


def test_each_event_makes_its_piece_and_empty_deltas_none() -> None:
    lp = [{"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": []}]
    tools: list[ToolDelta] = [{"index": 0, "id": "call_1", "name": "f", "arguments": ""}]
    got = pieces([delta(0, "he", prompt_tokens=4), delta(1, ""), delta(2, "", lp=lp),
                  delta(3, "", tools=tools), done(4)])
    assert got == [Delta(0, 0, "he", None, None), Delta(0, 2, "", lp, None),
                   Delta(0, 3, "", None, tools), Final(0, 4, done(4))]


def test_choices_keep_their_index_and_usage_sums_every_final() -> None:
    async def read() -> tuple[list[Piece], Fold]:
        fold = Fold(source([delta(0, "a", i=1), delta(0, "b", i=0), done(1, i=0),
                            error(1, i=1)]), 2)
        async with fold:
            await fold.start()
            return [piece async for piece in fold], fold

    got, fold = asyncio.run(read())
    assert [(type(p).__name__, p.i) for p in got] == [
        ("Delta", 1), ("Delta", 0), ("Final", 0), ("Failure", 1)]
    assert isinstance(got[-1], Failure) and isinstance(got[-1].error, Unavailable)
    assert fold.done == 1 and len(fold.finals) == 2
    assert fold.usage() == {"prompt_tokens": 6, "completion_tokens": 3}


def test_an_error_first_is_raised_by_start_and_the_events_are_closed() -> None:
    closed: list[bool] = []

    async def read() -> None:
        fold = Fold(source([error(0, status=504), done(1)], closed))
        async with fold:
            await fold.start()

    with pytest.raises(ApiError) as caught:
        asyncio.run(read())
    assert caught.value.status == 504 and closed == [True]


def test_start_tells_the_prompts_count_from_a_first_delta_or_final() -> None:
    async def prompt_tokens(events: list[Event]) -> int:
        fold = Fold(source(events))
        async with fold:
            await fold.start()
            return fold.prompt_tokens

    assert asyncio.run(prompt_tokens([delta(0, "x", prompt_tokens=9), done(1)])) == 9
    assert asyncio.run(prompt_tokens([done(0, prompt=7)])) == 7
    assert asyncio.run(prompt_tokens([delta(0, "x"), done(1)])) == 0


def test_a_whole_reply_joins_each_choices_text() -> None:
    lp = [{"token": "b", "logprob": -1.0, "bytes": [98], "top_logprobs": []}]
    events: list[Event] = [delta(0, "a", i=0), delta(0, "b", i=1, lp=lp), delta(1, "c", i=0),
              done(2, i=0), done(1, i=1, finish="length")]
    reply = asyncio.run(Fold(source(events), 2).whole())
    assert reply.texts == ["ac", "b"] and reply.lps == [[], lp]
    assert [f["finish"] for f in reply.finals] == ["stop", "length"]
    assert reply.usage() == {"prompt_tokens": 6, "completion_tokens": 4}


def test_a_whole_reply_raises_the_first_failure_and_closes_the_events() -> None:
    closed: list[bool] = []
    events: list[Event] = [delta(0, "a", i=0), error(1, status=500, i=1), done(2, i=0)]
    with pytest.raises(ApiError) as caught:
        asyncio.run(Fold(source(events, closed), 2).whole())
    assert caught.value.status == 500 and closed == [True]


def test_a_cancelled_reply_is_never_whole() -> None:
    with pytest.raises(ApiError) as caught:
        asyncio.run(Fold(source([delta(0, "cut"), done(1, finish="cancelled")])).whole())
    assert caught.value.code == "request_cancelled" and caught.value.status == 503


def test_an_embeddings_reply_has_its_vectors() -> None:
    events: list[Event] = [{"t": "embedding", "seq": 0, "data": [[0.5, 1.0]]}, done(1)]
    reply = asyncio.run(Fold(source(events)).whole())
    assert reply.vectors == [[0.5, 1.0]] and reply.final["usage"]["prompt_tokens"] == 3
    assert pieces(events)[0] == Vectors(0, 0, [[0.5, 1.0]])


def test_stored_events_fold_as_streamed_ones() -> None:
    events: list[Event] = [delta(0, "he"), delta(1, ""), delta(2, "llo"), done(3)]
    assert stored(events) == pieces(events)
