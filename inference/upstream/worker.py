"""The upstream worker: serves an `openai_upstream` deployment from the same Redis queue
as a model worker, each admitted request a streamed call to the upstream server.

Run it like any worker (`python -m inference.worker --spec JSON`, `manage.py runworker`,
the autoscaler's supervisor: inference/worker.py `serve` picks this class for upstream
deployments). The delivery contract is inference/worker.py's, through the same parts:

  intake      (inference/engine/intake.py) reading, reaping dead workers' entries,
              dead letters, the backlog, cancel flags, what an earlier delivery streamed
  scheduling  (inference/engine/batch_scheduler.py, over inference/engine/scheduler.py)
              priorities, tenant fairness, each tenant's share of the calls in flight
              while others wait, the last delivery alone, deadlines in the queue
  writer      (inference/engine/writer.py) events before acks, each final once
  health      (inference/engine/health.py) heartbeats, the memory guard, batch spans
and, in place of the model's parts, the calls (inference/upstream/calls.py): one task
each on an asyncio event loop. The batch is the calls in flight: up to the upstream's
`concurrency` (the spec's max_batch_size is not used). A call in flight is never
paused for another tenant (it could only be cancelled and continued, re-tokenized by
the upstream); instead, beyond its share and not alone, a tenant leaves one slot free
(`_RESERVE`) for a tenant that arrives later.

One thread runs it all, on that event loop: per iteration, synchronously,
  heartbeat -> reap -> pull -> cancellations -> admit (start calls) -> write
then, while calls run (or close after a cancellation), the loop runs them until one of
them has an event, or max_wait_ms passes (new entries are read at least that often).
The parts' Redis calls block the loop for a round trip each; their one long wait, the
intake's blocking read, happens only when no call runs or closes (then it never
blocks), so no call waits on it; and a call's events reach the writer without crossing
threads.

- Cancellation: a cancelled running request's call is cancelled (the HTTP request
  closes, the upstream stops generating); its final event is `cancelled`, billed the
  delta events already sent as completion tokens (the upstream's own count never came).
- Takeover: a redelivered request resumes from what its own stream holds (the intake's
  `streamed`): the text of its delta events as a `Continuation` (the client sends
  prompt + text and asks only for what is left), billed one token per delta event; a
  request an earlier delivery finished is only acknowledged (its final re-sent).
- A job's `resume` (a model alias's call continued after another deployment's
  upstream died mid-reply: streaming/pipeline/routed.py) is continued the same way, its events
  numbered on from its `seq`; a takeover of such a request continues after both.
- Usage is the upstream's (the client's final event); deadlines reach the client.
- On Redis errors the worker forgets its local work (the entries stay pending and are
  resumed); on a failure it hands its requests back; on SIGTERM (`stopping`) it lets
  running calls finish for up to drain_s, then cancels the rest and hands them back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from secrets import token_hex

import redis
import uvloop

from inference import queue as q
from inference.engine.batch_scheduler import BatchScheduler, running_share
from inference.engine.entries import (
    Pending,
    RequestError,
    dead_lettered,
    malformed,
)
from inference.engine.health import Health
from inference.engine.intake import Intake
from inference.engine.output import done_event, error_event
from inference.engine.writer import Outbox, Writer
from inference.jobs import ChatJob, Continuation, Event, JobError
from inference.runtimes.base import process_memory
from inference.spec import DeploymentSpec
from inference.upstream.calls import Calls
from inference.upstream.client import UpstreamClient

logger = logging.getLogger("sluice.worker")
_MAX_EVENT_WAIT_S = 0.05
_RESERVE = 1  # calls kept free for a later tenant (no call is paused to make room)


@dataclass
class Running:
    """A request whose call is in flight: the next event's sequence number and the
    delta events sent (a cancelled call's cost)."""

    pending: Pending
    next_seq: int = 0
    deltas: int = 0


class _Process:
    """What health measures of a worker without a model: the process's memory."""

    def memory(self) -> tuple[int, int]:
        return process_memory()


class UpstreamWorker:
    def __init__(self, spec: DeploymentSpec, client: redis.Redis, *,
                 worker_id: str | None = None, block_ms: int = 1000,
                 heartbeat_s: float = 1.0, reclaim_after_ms: int | None = None,
                 private_ok: bool | None = None) -> None:
        if spec.upstream is None:
            raise ValueError(f"{spec.name} is not an upstream deployment")
        # The batch is the calls in flight: the intake holds up to twice that, the
        # scheduler fills it, the heartbeat reports it.
        self.spec = replace(spec, max_batch_size=spec.upstream.concurrency)
        self.redis = client
        self.id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{token_hex(3)}"
        self.block_ms = block_ms
        self.private_ok = private_ok
        self.stopping = threading.Event()
        self.health = Health(self.spec, client, self.id, _Process(), heartbeat_s=heartbeat_s)
        self.intake = Intake(self.spec, client, self.id, stopping=self.stopping,
                             reclaim_after_ms=reclaim_after_ms or int(str(
                                 spec.extra.get("reclaim_after_ms", 30000))))
        self.outbox = Outbox(served=self.health.served)
        self.writer = Writer(client, spec.name, self.id)
        self.active: dict[str, Running] = {}  # the requests whose calls run, by id
        self._calls: Calls | None = None  # made on the loop, by run()
        self._news: asyncio.Event | None = None  # a call had an event, or ended
        self._event_wait_s = min(_MAX_EVENT_WAIT_S, max(0.001, spec.max_wait_ms / 1000))
        self.scheduler = BatchScheduler(self.intake, self.outbox, self.health,
                                        max_batch_size=self.spec.max_batch_size,
                                        max_deliveries=spec.max_deliveries,
                                        share=running_share(spec),
                                        reserve=min(_RESERVE, self.spec.max_batch_size - 1))

    @property
    def admitted(self) -> deque[list[str]]:
        """The request ids of the most recent admissions (tests and debugging)."""
        return self.scheduler.admitted

    @property
    def backlog(self) -> list[Pending]:
        return self.intake.backlog

    @property
    def calls(self) -> Calls:
        assert self._calls is not None, "the worker is not running"  # noqa: S101
        return self._calls

    # -- life cycle ----------------------------------------------------------------
    def run(self, *, drain_s: float = 10.0) -> None:
        """Serve until `stopping` is set, then drain, on an event loop of its own:
        uvloop's (its transports and callbacks cost a fraction of asyncio's) when the
        worker owns the process's main thread (runworker, the supervisor's workers);
        asyncio's own when it runs in another thread (tests, embedding), where a uvloop
        loop left the interpreter crashing at exit."""
        main = threading.current_thread() is threading.main_thread()
        with asyncio.Runner(loop_factory=uvloop.new_event_loop if main else None) as runner:
            runner.run(self._run(drain_s))

    async def _run(self, drain_s: float) -> None:
        logger.info("upstream worker %s serving %s", self.id, self.spec.name)
        client = UpstreamClient(self.spec, private_ok=self.private_ok)
        news = self._news = asyncio.Event()
        self._calls = Calls(client, self._on_event, news.set)
        try:
            try:
                while not self.stopping.is_set():
                    try:
                        self.iterate()
                        if self._calls:  # calls run (or close): let them
                            await self._wait(self._event_wait_s)
                    except redis.RedisError:
                        logger.exception("Redis failed; dropping local work, it will be "
                                         "resumed")
                        await self._abandon()
                        await asyncio.sleep(1.0)
            except Exception:
                logger.exception("worker %s failed; handing its requests back", self.id)
                await self._hand_back()
                raise
            await self._drain(drain_s)
        finally:
            await client.aclose()

    def iterate(self) -> None:
        """One round of the queue's work (synchronous: see the module docstring)."""
        now, intake = time.monotonic(), self.intake
        self.health.beat_if_due(now, batch=len(self.active), backlog=len(intake.backlog))
        if now >= intake.next_maintenance:
            for pending in intake.maintain(now, self._running()):
                self.outbox.final(pending, error_event(dead_lettered()))
        # Calls still closing count as running: a blocking read would stall them.
        intake.pull(running=len(self.calls), block_ms=self.block_ms,
                    in_rotation=self.health.guard.in_rotation,
                    others_in_rotation=self.health.others_in_rotation)
        cancelled = intake.cancellations(now, self.active) \
            if now >= intake.next_cancel_check else None
        if cancelled is not None:
            for pending in cancelled.waiting:
                self.outbox.final(pending, done_event(0, "cancelled", prompt_tokens=0,
                                                      completion_tokens=0))
            for rid in cancelled.running:
                self._cancel(rid)
        if intake.backlog:
            self._admit()
        self._flush()

    async def _wait(self, timeout_s: float) -> None:
        """Let the calls run until one has an event or ends, at most `timeout_s`; then
        write what they sent."""
        news = self._news
        assert news is not None  # noqa: S101
        if not self.outbox:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await news.wait()
            if self.active:
                # The other calls whose replies came in the same moment add theirs: one
                # write for all of them.
                await asyncio.sleep(0)
        news.clear()
        self._flush()

    def _running(self) -> Iterator[Pending]:
        return (running.pending for running in self.active.values())

    def _cancel(self, rid: str) -> None:
        running = self.active.pop(rid)
        self.calls.cancel(rid)
        self.outbox.final(running.pending, done_event(
            running.next_seq, "cancelled", prompt_tokens=0, completion_tokens=running.deltas))

    def _flush(self, *, wait: bool = False) -> None:
        # On this thread: nothing else would run meanwhile but the calls, whose events
        # wait in the outbox for the next write.
        if self.outbox or wait:
            self.writer.flush(self.outbox, background=False, wait=wait)

    async def _hand_back(self) -> None:
        """After a failure: write what the calls already sent (a takeover resumes after
        it), then release every request held for the next reap of any live worker."""
        await self.calls.close()
        with contextlib.suppress(Exception):
            self._flush(wait=True)
        with contextlib.suppress(redis.RedisError):
            self.intake.release(self.backlog)
            self.intake.release(self._running(), failed=True)
        self.health.end_batches("failed")
        self.writer.close(wait=False)

    async def _abandon(self) -> None:
        """Forget everything held locally; the entries stay pending in Redis and are
        resumed (after reclaim_after_ms) from what reached their streams."""
        self.writer.abandon()
        self.active.clear()  # first: the calls' last events are nobody's
        await self.calls.close()
        self.backlog.clear()
        self.outbox.take()
        self.health.end_batches("abandoned")

    async def _drain(self, drain_s: float) -> None:
        """Let running calls finish (up to drain_s), hand everything else back."""
        deadline = time.monotonic() + drain_s
        self.intake.release(self.backlog)
        self.backlog.clear()
        while self.active and time.monotonic() < deadline:
            await self._wait(min(self._event_wait_s, max(0.0, deadline - time.monotonic())))
        await self.calls.close()  # what they sent is in the outbox, nothing after it
        self._flush(wait=True)
        self.intake.release(self._running())
        self.active.clear()
        self.health.end_batches("released")
        self.writer.close(wait=True)
        self.health.leave()

    # -- calls ---------------------------------------------------------------------
    def _admit(self) -> None:
        chosen = self.scheduler.next(self.active)
        for pending in chosen:
            try:
                self._start(pending)
            except RequestError as exc:
                self.outbox.final(pending, error_event(exc))

    def _start(self, pending: Pending) -> None:
        """Start `pending`'s call: afresh, or after what an earlier delivery streamed."""
        try:
            job = pending.req.job()
            if not isinstance(job, ChatJob):
                raise JobError(f"a {pending.req.kind} request on a chat model")
            if job.prompt is None and not job.messages:
                raise JobError("a chat job needs messages or a prompt")
        except JobError as exc:
            raise malformed(exc) from None
        continuation = job.resume  # what another deployment streamed (a model alias's)
        if pending.deliveries > 1:
            earlier = self.intake.streamed(pending.req)
            if earlier.final is not None:  # an earlier delivery finished it
                self.writer.resend(pending.req, earlier.final)
                self.outbox.ack(pending)
                return
            if any("tools" in d for d in earlier.deltas):
                # A tool call's pieces went out: no upstream continues a call half
                # written (the gateway does not fall back after them either).
                cut = RequestError(502, "upstream_cannot_resume", "The reply was cut off "
                                   "while it called a tool; send the request again.")
                self.outbox.final(pending, error_event(
                    cut, seq=earlier.deltas[-1]["seq"] + 1, cost=(0, len(earlier.deltas))))
                return
            if earlier.deltas:
                before = job.resume or Continuation(text="", seq=0, completion_tokens=0)
                continuation = Continuation(
                    text=before.text + "".join(d["text"] for d in earlier.deltas),
                    seq=earlier.deltas[-1]["seq"] + 1,
                    completion_tokens=before.completion_tokens + len(earlier.deltas))
        rid = pending.req.rid
        self.active[rid] = Running(pending, next_seq=continuation.seq if continuation else 0,
                                   deltas=continuation.completion_tokens if continuation
                                   else 0)
        left_s = (pending.deadline_ms - q.now_ms()) / 1000
        self.calls.start(rid, job, tenant=pending.tenant, continuation=continuation,
                         deadline=time.monotonic() + left_s)

    def _on_event(self, rid: str, event: Event) -> None:
        """A call's event (on the loop, from its task): to the outbox."""
        running = self.active.get(rid)
        if running is None:
            return  # its call was cancelled or handed back: nothing after that is sent
        if event["t"] == "done" or event["t"] == "error":
            del self.active[rid]
            self.outbox.final(running.pending, event)
        else:
            running.next_seq = event["seq"] + 1
            running.deltas += 1
            self.outbox.add(running.pending.req, event)
        assert self._news is not None  # noqa: S101
        self._news.set()
