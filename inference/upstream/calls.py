"""An upstream worker's calls in flight: one task each on the worker's event loop, over
the deployment's one `UpstreamClient` (inference/upstream/client.py: at most
`concurrency` requests in flight, one connection pool).

- `start(rid, job, ...)` starts request `rid`'s call; each of its events, in order, is
  handed to `on_event(rid, event)` as it arrives, the last one a final event; `on_end()`
  when its task has ended (it no longer counts in `len()`);
- `cancel(rid)` cancels the call's task: the client's stream is closed, which closes the
  HTTP request (the upstream stops generating), and `on_event` gets nothing more of it;
- `close()` cancels every call and waits for their tasks.
A call that fails in a way the client does not type (a bug) still ends with a final
event: a retriable 502, so the request is not left waiting for its deadline.
Everything here runs on the loop's thread (the worker's), so `on_event` needs no lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from inference.jobs import ChatJob, Continuation, ErrorEvent, Event, usage
from inference.upstream.client import UpstreamClient

logger = logging.getLogger("sluice.upstream")


class Calls:
    def __init__(self, client: UpstreamClient, on_event: Callable[[str, Event], None],
                 on_end: Callable[[], None]) -> None:
        self.client = client
        self._on_event = on_event
        self._on_end = on_end  # a call's task ended (after its last event, or cancelled)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ending: set[asyncio.Task[None]] = set()  # cancelled, closing their requests

    def __len__(self) -> int:
        """The calls running or still closing after a cancellation: the loop must keep
        running them (their HTTP requests close only then)."""
        return len(self._tasks) + len(self._ending)

    def start(self, rid: str, job: ChatJob, *, tenant: str,
              continuation: Continuation | None, deadline: float) -> None:
        """Start request `rid`'s call (`deadline`: time.monotonic())."""
        task = asyncio.get_running_loop().create_task(
            self._call(rid, job, tenant, continuation, deadline), name=f"upstream:{rid}")
        self._tasks[rid] = task
        task.add_done_callback(lambda _t: self._ended(rid, task))

    def _ended(self, rid: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(rid) is task:
            del self._tasks[rid]
        self._ending.discard(task)
        self._on_end()

    async def _call(self, rid: str, job: ChatJob, tenant: str,
                    continuation: Continuation | None, deadline: float) -> None:
        seq = continuation.seq if continuation is not None else 0  # the next event's
        try:
            async for event in self.client.stream(job, tenant=tenant,
                                                  continuation=continuation,
                                                  deadline=deadline):
                seq = event["seq"] + 1
                self._on_event(rid, event)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("upstream call for request %s failed", rid)
            failed: ErrorEvent = {
                "t": "error", "seq": seq, "status": 502, "code": "upstream_error",
                "message": "The call to the model's upstream server failed.",
                "usage": usage(0, 0)}
            self._on_event(rid, failed)

    def cancel(self, rid: str) -> None:
        """Stop request `rid`'s call (a no-op when it has ended)."""
        task = self._tasks.pop(rid, None)
        if task is not None and task.cancel():
            self._ending.add(task)

    async def close(self) -> None:
        """Cancel every call and wait for their tasks to end."""
        for rid in list(self._tasks):
            self.cancel(rid)
        await asyncio.gather(*self._ending, return_exceptions=True)
