"""An upstream worker's calls in flight, on an asyncio event loop in a thread of its own.

The worker's queue loop (inference/upstream/worker.py) is synchronous, like the parts it
reuses; the calls are I/O on httpx's async client, thousands of streams on one thread.
`Calls` owns that thread, its loop and the deployment's one `UpstreamClient`
(inference/upstream/client.py: at most `concurrency` requests in flight, one connection
pool). Between the two threads:

- `start(rid, job, ...)` (queue loop) schedules one call on the loop; its events, in
  order, end with exactly one final event, each put on `events` as (request id, event);
- `cancel(rid)` (queue loop) cancels the call's task: the client's stream is closed,
  which closes the HTTP request (the upstream stops generating); nothing more of that
  call is put on `events` once the cancellation runs, and the queue loop ignores any
  event of a call it no longer holds, so what it writes of a call is always a prefix;
- `close()` cancels what still runs, closes the client and stops the thread.

A call that fails in a way the client does not type (a bug) still ends with a final
event: a retriable 502, so the request is not left waiting for its deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from queue import SimpleQueue
from typing import Any

from inference.jobs import ChatJob, ErrorEvent, Event, usage
from inference.spec import DeploymentSpec
from inference.upstream.body import Continuation
from inference.upstream.client import UpstreamClient

logger = logging.getLogger("sluice.upstream")
_CLOSE_S = 5.0


class Calls:
    def __init__(self, spec: DeploymentSpec, *, private_ok: bool | None = None) -> None:
        self.events: SimpleQueue[tuple[str, Event]] = SimpleQueue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"sluice-upstream:{spec.name}")
        self._thread.start()
        self._running: dict[str, concurrent.futures.Future[None]] = {}

        async def build() -> UpstreamClient:  # its pool and semaphore belong to the loop
            return UpstreamClient(spec, private_ok=private_ok)

        self.client = self._submit(build()).result()

    def _submit(self, work: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(work, self._loop)

    def start(self, rid: str, job: ChatJob, *, tenant: str,
              continuation: Continuation | None, deadline: float) -> None:
        """Start the call for request `rid` (`deadline`: time.monotonic())."""
        future = self._submit(self._call(rid, job, tenant, continuation, deadline))
        self._running[rid] = future
        future.add_done_callback(lambda _f: self._running.pop(rid, None))

    async def _call(self, rid: str, job: ChatJob, tenant: str,
                    continuation: Continuation | None, deadline: float) -> None:
        put = self.events.put
        seq = continuation.seq if continuation is not None else 0  # the next event's
        try:
            async for event in self.client.stream(job, tenant=tenant,
                                                  continuation=continuation,
                                                  deadline=deadline):
                seq = event["seq"] + 1
                put((rid, event))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("upstream call for request %s failed", rid)
            failed: ErrorEvent = {
                "t": "error", "seq": seq, "status": 502, "code": "upstream_error",
                "message": "The call to the model's upstream server failed.",
                "usage": usage(0, 0)}
            put((rid, failed))

    def cancel(self, rid: str) -> None:
        """Stop request `rid`'s call (a no-op when it has ended)."""
        future = self._running.pop(rid, None)
        if future is not None:
            future.cancel()

    def cancel_all(self) -> None:
        for rid in list(self._running):
            self.cancel(rid)

    def close(self) -> None:
        """Cancel every call, close the client's connections, stop the loop's thread."""
        self.cancel_all()

        async def shut() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.client.aclose()

        if self._thread.is_alive():
            try:
                self._submit(shut()).result(_CLOSE_S)
            except (concurrent.futures.TimeoutError, RuntimeError):
                logger.warning("upstream calls did not close in %.0f s", _CLOSE_S)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_CLOSE_S)
        if not self._thread.is_alive():
            self._loop.close()
