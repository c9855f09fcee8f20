"""`n` choices of one chat call: admitted once, generated as n sequences.

The gateway admits a call with n > 1 once for all its choices (n times the token bound:
one rate-limit admission, one quota reservation) and submits one queue entry per choice,
each its own request id; with a caller's `seed` s, choice i is seeded s + i, so the
choices differ and each is reproducible. Entered together, they reach a worker together
and join the same batch; their prefill is one batched forward pass, but the prompt's KV
is computed per choice (no prefix sharing in this runtime yet).

`merged` yields the n requests' events as they arrive, each tagged with its choice
index (`event["i"]`), and ends when all n have ended. The call settles once, with
`combined(finals)`: the usage summed over its choices. When its consumer stops early
(client gone, deadline, an error), every choice still running is cancelled and the call
settles when their final events arrive (`settle_later`).

n > 1 is for fresh calls: with an Idempotency-Key, a resume (Last-Event-ID,
`last_offset`) or a conversation it is a 400 (`check`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Sequence
from typing import Any

import msgspec
from redis.exceptions import RedisError

from governance.admission import Admission
from inference.client import RequestHandle
from inference.jobs import (
    ChatJob,
    Event,
    FinalEvent,
    Job,
    is_done,
    is_error,
    is_final,
    summed,
)
from sluice.aio import finish_or_cancel
from sluice.errors import ApiError, BadRequest, DeadlineExceeded

_SETTLE_WAIT_GRACE_S = 5.0
# Settlements and clean-ups still waiting for workers' final events; each loop's are
# finished by its gateway's close().
_background: set[asyncio.Task[None]] = set()


def check(n: int, *, idempotency_key: str | None = None, resume: bool = False,
          conversation_id: str | None = None) -> None:
    """Refuse what a call with n > 1 choices cannot have (a 400 naming `n`): a resume
    or an idempotent retry would have to replay n streams, and a conversation would have
    to keep one of n replies."""
    if n <= 1:
        return
    what = ("an Idempotency-Key" if idempotency_key is not None else
            "a resumed stream" if resume else
            "a conversation" if conversation_id is not None else None)
    if what is not None:
        raise BadRequest(f"n > 1 cannot be used with {what}; send n = 1.", param="n",
                         code="unsupported_parameter")


def jobs(job: ChatJob, n: int) -> list[ChatJob]:
    """The job of each choice: the call's, seeded seed + i when it has a seed."""
    seed = job.seed
    return [job if seed is None else msgspec.structs.replace(job, seed=seed + i)
            for i in range(n)]


async def submit_all(submit: Callable[[Job], Awaitable[RequestHandle]],
                     entries: Sequence[Job]) -> list[RequestHandle]:
    """Enqueue every entry at once (their scripts share a Redis round trip). All or
    nothing: if one is refused (or the caller leaves), those enqueued are cancelled
    and the first error is raised."""
    tasks = [asyncio.ensure_future(submit(entry)) for entry in entries]
    try:
        await asyncio.wait(tasks)
    except BaseException:
        for task in tasks:
            task.cancel()  # a submit cancelled mid-way abandons its own entry
            task.add_done_callback(_abandon_result)
        raise
    errors = [exc for task in tasks if (exc := task.exception()) is not None]
    if errors:
        for task in tasks:
            _abandon_result(task)
        raise errors[0]
    return [task.result() for task in tasks]


def _abandon_result(task: asyncio.Future[RequestHandle]) -> None:
    if task.done() and not task.cancelled() and task.exception() is None:
        _in_background(_abandon(task.result()))


async def _abandon(handle: RequestHandle) -> None:
    """Cancel a request nobody will read, and read it to its end (which frees what the
    client keeps for it)."""
    await handle.cancel()
    with contextlib.suppress(ApiError, RedisError):
        async for _event in handle.events():
            pass


async def merged(handles: list[RequestHandle]) -> AsyncGenerator[Event]:
    """Every handle's events as they arrive, tagged `"i"` (the choice index), in order
    within a choice; ends after the last final event. An error raised by a handle (its
    deadline) is raised here; the other handles are left to the caller to cancel."""
    queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        try:
            async for event in handle.events():
                event["i"] = i
                queue.put_nowait(event)
        except Exception as exc:
            queue.put_nowait(exc)

    pumps = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        running = len(handles)
        while running:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if is_final(item):
                running -= 1
            yield item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def combined(finals: list[FinalEvent]) -> FinalEvent | None:
    """The final event the call settles with: its first choice's error if one failed,
    else a `done`; usage summed over the choices; `finish` "cancelled" if any choice
    was cancelled, else the first choice's. None when no choice ended."""
    if len(finals) <= 1:
        return finals[0] if finals else None
    ordered = sorted(finals, key=lambda e: e.get("i", 0))
    failed = [e for e in ordered if is_error(e)]
    base = failed[0] if failed else ordered[0]
    finishes = [e.get("finish") for e in ordered]
    merged = base.copy()
    merged["usage"] = summed(ordered)
    if is_done(merged) and "cancelled" in finishes:
        merged["finish"] = "cancelled"
    return merged


def settle_later(admission: Admission, handles: list[RequestHandle],
                 finals: list[FinalEvent], error: BaseException) -> None:
    """The consumer stopped before every choice ended: cancel the ones still running,
    and settle the call once their final events arrive (within milliseconds of a
    cancel), or at the deadline (with what arrived)."""
    async def run() -> None:
        seen = {int(e.get("i", 0)) for e in finals}
        missing = [(i, h) for i, h in enumerate(handles) if i not in seen]
        with contextlib.suppress(ApiError, RedisError):
            await asyncio.gather(*(h.cancel() for _i, h in missing))
        late: list[FinalEvent] = []
        if not isinstance(error, DeadlineExceeded):
            late = [e for e in await asyncio.gather(*(_final_of(i, h) for i, h in missing))
                    if e is not None]
        await admission.finish(combined([*finals, *late]), error=error)

    _in_background(run())


async def _final_of(i: int, handle: RequestHandle) -> FinalEvent | None:
    timeout = max(0.0, handle.deadline_ms / 1000 - time.time()) + _SETTLE_WAIT_GRACE_S
    final = None
    with contextlib.suppress(ApiError, RedisError):
        async for event in handle.client.replay(handle.tenant, handle.rid,
                                                after_seq=2**62, timeout_s=timeout):
            if is_final(event):
                final = event
                final["i"] = i
    return final


def _in_background(work: Coroutine[Any, Any, None]) -> None:
    task = asyncio.create_task(work)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def close(grace_s: float = 2.0) -> None:
    """Shutdown: give this loop's pending settlements `grace_s` to finish."""
    loop = asyncio.get_running_loop()
    await finish_or_cancel([t for t in _background if t.get_loop() is loop], grace_s)
