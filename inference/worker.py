"""The worker: pulls dynamic batches from a deployment's Redis stream, runs the model,
streams results back, and acknowledges. One process per worker; run it with
`manage.py runworker --deployment NAME` or `python -m inference.worker --spec JSON`.

Per iteration:
  heartbeat -> reap stale entries of dead workers -> pull -> cancellations -> admit
  (fair, by priority) -> one decode step for the running batch -> publish + ack.
When steps are long (a model's forward pass), the next step runs on the model thread
while this thread does all of that for the previous one (inference/engine/engine.py),
and the writer thread writes the previous step's events meanwhile.

Delivery is at-least-once with no duplicates visible to the caller:
- every event carries a sequence number, and is written to the request's own stream
  before the entry is acknowledged;
- a worker that takes over a request (after the first one died) reads what was already
  streamed, feeds those tokens back as context and continues from there;
- the `done` marker is set once (SET NX), so only one final event (one charge) exists;
- an entry delivered more than `max_deliveries` times goes to the dead-letter stream and
  its caller gets a clear error.

The `Worker` wires the parts of inference/engine/ (each module states its contract):
  intake.py   reads entries (XREADGROUP), reaps dead workers' entries, dead-letters,
              holds the backlog, looks up cancellations, hands entries back
  batch_scheduler.py
              which waiting requests start now, and which running ones give way to
              tenants below their share (scheduler.py, pure, decides)
  inputs.py   a job into the engine's sequence (prompt, sampling, grammar)
  engine.py   the runtime's sequences and steps, overlapped on the model thread
  output.py   tokens into events: detokenizing, stop strings, logprobs, finishes
  writer.py   the outbox, and the writer thread: events, finals once, acks
  health.py   heartbeats, the memory guard, batch spans
On a failure the worker hands its requests back at once (crash-only); on Redis errors
it forgets its local work (the entries stay pending and are resumed); on SIGTERM it
finishes what runs, up to drain_s, and hands the rest back.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from secrets import token_hex
from typing import Any

import redis

from inference import queue as q
from inference.engine.batch_scheduler import BatchScheduler, running_share
from inference.engine.engine import OVERLAP_MIN_STEP_S, Engine
from inference.engine.entries import (
    Pending,
    RequestError,
    dead_lettered,
)
from inference.engine.health import Health
from inference.engine.inputs import InputProcessor, embed_texts
from inference.engine.intake import Cancelled, Intake
from inference.engine.output import OutputProcessor, Row, done_event, error_event
from inference.engine.writer import Outbox, Writer
from inference.runtimes import load_runtime
from inference.runtimes.base import ChatRuntime, EmbeddingRuntime, NewSequence
from inference.spec import DeploymentSpec, RuntimeName
from inference.upstream.worker import UpstreamWorker
from sluice import gctuning
from sluice.observability import telemetry
from sluice.processes import set_on_signals
from sluice.redis import sync_client

logger = logging.getLogger("sluice.worker")


class Worker:
    def __init__(
        self,
        spec: DeploymentSpec,
        client: redis.Redis,
        *,
        runtime: ChatRuntime | EmbeddingRuntime | None = None,
        worker_id: str | None = None,
        block_ms: int = 1000,
        heartbeat_s: float = 1.0,
        reclaim_after_ms: int | None = None,
        overlap_min_step_s: float = OVERLAP_MIN_STEP_S,
    ) -> None:
        self.spec = spec
        self.redis = client
        self.runtime = runtime if runtime is not None else load_runtime(spec)
        self.id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{token_hex(3)}"
        self.block_ms = block_ms
        self.stopping = threading.Event()
        self.health = Health(spec, client, self.id, self.runtime, heartbeat_s=heartbeat_s)
        self.intake = Intake(spec, client, self.id, stopping=self.stopping,
                             reclaim_after_ms=reclaim_after_ms or int(str(
                                 spec.extra.get("reclaim_after_ms", 30000))))
        self.engine = Engine(self.runtime, overlap_min_step_s=overlap_min_step_s)
        self.outbox = Outbox(served=self.health.served)
        self.output = OutputProcessor(self.outbox, self.runtime,
                                      device_s=self.engine.take_device_s)
        self.inputs = InputProcessor(self.runtime, model_name=spec.name) \
            if isinstance(self.runtime, ChatRuntime) else None
        self.writer = Writer(client, spec.name, self.id)
        # An idle embedding worker waits up to max_wait_ms for a fuller batch.
        self._gather = isinstance(self.runtime, EmbeddingRuntime)
        self.scheduler = BatchScheduler(self.intake, self.outbox, self.health,
                                        max_batch_size=spec.max_batch_size,
                                        max_deliveries=spec.max_deliveries,
                                        share=running_share(spec))
        self.preempted = 0  # running requests paused for another tenant (tests, debugging)

    @property
    def active(self) -> dict[str, Row]:
        """The running requests, by request id."""
        return self.output.rows

    @property
    def admitted(self) -> deque[list[str]]:
        """The request ids of the most recent admissions (tests and debugging)."""
        return self.scheduler.admitted

    @property
    def backlog(self) -> list[Pending]:
        """The entries read and not yet admitted."""
        return self.intake.backlog

    @property
    def overlapped(self) -> int:
        """How many steps ran on the model thread."""
        return self.engine.overlapped

    # -- life cycle ----------------------------------------------------------------
    def run(self, *, drain_s: float = 10.0) -> None:
        logger.info("worker %s serving %s", self.id, self.spec.name)
        try:
            while not self.stopping.is_set():
                try:
                    self.iterate()
                except redis.RedisError:
                    logger.exception("Redis failed; dropping local work, it will be resumed")
                    self._abandon()
                    self.stopping.wait(1.0)
        except Exception:
            # Crash-only (a model or CUDA error may leave this process unusable), but
            # the requests need not wait reclaim_after_ms for a reaper to notice.
            logger.exception("worker %s failed; handing its requests back", self.id)
            self._hand_back()
            raise
        self._drain(drain_s)

    def iterate(self) -> None:
        # The periodic duties are due-time compares here, not calls: this runs once per
        # decode step (per token, for a runtime without a model).
        now = time.monotonic()
        rows, intake = self.output.rows, self.intake
        if now >= self.health.next_beat:
            self.health.beat(now, batch=len(rows), backlog=len(intake.backlog))
        if now >= intake.next_maintenance:
            for pending in intake.maintain(now, self._running()):
                self.outbox.final(pending, error_event(dead_lettered()))
        intake.others = self.health.others_live  # their lanes are theirs (placement)
        intake.pull(running=len(rows), block_ms=self.block_ms,
                    in_rotation=self.health.guard.in_rotation,
                    others_in_rotation=self.health.others_in_rotation, gather=self._gather)
        if now >= intake.next_cancel_check:
            self._cancel(intake.cancellations(now, rows))
        if intake.backlog:
            self._admit()
        if rows:
            self._decode_step()
        self._flush()
        if not rows:
            # The batch has ended (or was cancelled whole before its step was handled):
            # free its sequences now, not after the next read (which may block for
            # block_ms). Its finals are written already; the last step's tokens are
            # nobody's.
            self.engine.settle()

    def _cancel(self, cancelled: Cancelled | None) -> None:
        if cancelled is None:
            return
        for pending in cancelled.waiting:
            if pending.req.rid in self.output.parked:
                self.output.finish_parked(pending.req.rid, "cancelled")
                continue
            self.outbox.final(pending, done_event(0, "cancelled", prompt_tokens=0,
                                                  completion_tokens=0))
        for rid in cancelled.running:
            self.output.finish(rid, "cancelled")
        self.engine.drop(cancelled.running)

    def _running(self) -> Iterator[Pending]:
        return (row.pending for row in self.active.values())

    def _hand_back(self) -> None:
        """After a failure: write what was already made (a takeover resumes after it),
        then release every request held, as a drain does, for the next reap of any
        live worker (within a third of its reclaim_after_ms) instead of after
        reclaim_after_ms of silence."""
        with contextlib.suppress(Exception):
            self._flush(wait=True)
        with contextlib.suppress(redis.RedisError):
            self.intake.release(self.backlog)  # waiting: not part of what failed
            self.intake.release(self._running(), failed=True)
        self.health.end_batches("failed")
        self.writer.close(wait=False)
        self.engine.close(wait=False)

    def _abandon(self) -> None:
        """Forget everything held locally. The entries stay pending in Redis, so after
        reclaim_after_ms a worker (this one too) takes them over and resumes each from
        the events that did reach its stream: nothing is lost or repeated."""
        self.writer.abandon()
        self.engine.abandon()
        self.output.clear()
        self.backlog.clear()
        self.outbox.take()
        self.health.end_batches("abandoned")

    def _drain(self, drain_s: float) -> None:
        """Finish what is running (up to drain_s), hand everything else back."""
        deadline = time.monotonic() + drain_s
        self.intake.release(self.backlog)
        self.backlog.clear()
        while self.active and time.monotonic() < deadline:
            self._decode_step()
            self._flush()
        self.engine.collect()  # a step still running: its tokens go unhandled, released below
        self._flush(wait=True)
        self.intake.release(self._running())
        self.output.clear()
        self.health.end_batches("released")
        self.writer.close(wait=True)
        self.engine.close(wait=True)
        self.health.leave()

    # -- admission -----------------------------------------------------------------
    def _admit(self) -> None:
        if self.inputs is not None:  # a chat runtime's rows can be paused
            self._preempt(self.scheduler.preempt(self.active))
            for rid in self.output.expired_parked(q.now_ms()):
                self.intake.take([self.output.finish_parked(rid, "deadline")])
        chosen = self.scheduler.next(self.active)
        if not chosen:
            return
        if isinstance(self.runtime, EmbeddingRuntime):
            self._embed(chosen)
        else:
            self._start(chosen)

    def _preempt(self, victims: list[str]) -> None:
        """Pause `victims` (recompute preemption): the tokens the engine made for them
        are handled first (a row may end on one), then they leave the runtime, and each
        row still going is parked, its entry back in the backlog ahead of its tenant's
        others. Re-admitted, it prefills its prompt and tokens and goes on."""
        if not victims:
            return
        for tokens in self.engine.pause(victims):
            self.output.handle(tokens)
        self.engine.drop(victims)
        for rid in victims:
            if rid in self.output.rows:
                self.intake.requeue(self.output.park(rid))
                self.preempted += 1

    def _start(self, chosen: list[Pending]) -> None:
        """Start the chosen requests: prepared, resumed after what an earlier delivery
        streamed (or, paused here, after what it had made), then added to the engine
        together (one prefill)."""
        assert self.inputs is not None  # noqa: S101
        new: list[NewSequence] = []
        for pending in chosen:
            if pending.req.rid in self.output.parked:
                new.append(self.output.unpark(pending.req.rid))
                continue
            try:
                prepared = self.inputs.prepare(pending)
            except RequestError as exc:
                self.outbox.final(pending, error_event(exc))
                continue
            row = prepared.row
            if prepared.count_only:
                self.outbox.final(pending, done_event(0, "stop", prompt_tokens=row.prompt_tokens,
                                                      completion_tokens=0))
                continue
            if pending.deliveries > 1:
                earlier = self.intake.streamed(pending.req)
                if earlier.final is not None:  # an earlier delivery finished it
                    self.writer.resend(pending.req, earlier.final)
                    self.outbox.ack(pending)
                    continue
                row.resume(earlier.deltas)
            seq = self.output.start(row, prepared.prompt, prepared.params)
            if seq is not None:
                new.append(seq)
        for seq, refusal in self.engine.add(new):
            # The KV cache cannot hold it: now (503: the client may retry once running
            # requests leave) or ever (400).
            self.output.fail(seq.rid, RequestError(refusal.status, refusal.code,
                                                   refusal.message, retry=refusal.retriable))

    def _embed(self, chosen: list[Pending]) -> None:
        texts: list[str] = []
        spans: list[tuple[Pending, int, int]] = []
        for pending in chosen:
            try:
                inputs = embed_texts(pending)
            except RequestError as exc:
                self.outbox.final(pending, error_event(exc))
                continue
            spans.append((pending, len(texts), len(texts) + len(inputs)))
            texts += inputs
        vectors, counts = self.engine.embed(texts)
        labels = getattr(self.engine.runtime, "labels", None)  # a classifier's
        for pending, lo, hi in spans:
            self.output.embedded(pending, vectors[lo:hi], sum(counts[lo:hi]), labels=labels)

    # -- generation ----------------------------------------------------------------
    def _decode_step(self) -> None:
        """Hand the running batch its next tokens (in the engine's order, each dict
        handled before the next is made: what ends leaves the runtime before an inline
        step)."""
        for tokens in self.engine.step():
            ended = self.output.handle(tokens)
            if ended:
                self.engine.drop(ended)

    def _flush(self, *, wait: bool = False) -> None:
        """Hand this iteration's events and acks to the writer: on its thread while a
        batch runs (the write overlaps the next step), else on this one."""
        outbox = self.outbox
        if outbox.events or outbox.acks or wait:
            self.writer.flush(outbox, background=bool(self.output.rows or self.intake.backlog),
                              wait=wait)


def heartbeats(client: redis.Redis, deployment: str, *,
               max_age_s: float = q.HEARTBEAT_MAX_AGE_S) -> dict[str, dict[str, Any]]:
    """Live workers of a deployment (heartbeat younger than max_age_s)."""
    return q.live_heartbeats(client.hgetall(q.workers_key(deployment)), max_age_s=max_age_s)


def serve(spec: DeploymentSpec, redis_url: str, **kwargs: Any) -> None:
    """Run a worker until SIGTERM/SIGINT, then drain (an upstream deployment's:
    inference/upstream/worker.py)."""
    telemetry.setup("sluice-worker")
    client = sync_client(redis_url, socket_timeout=30, socket_connect_timeout=5)
    worker: Worker | UpstreamWorker
    if spec.runtime == RuntimeName.OPENAI_UPSTREAM:
        worker = UpstreamWorker(spec, client, **kwargs)
    else:
        worker = Worker(spec, client, **kwargs)
    gctuning.tune()  # the model and the modules live as long as the process
    set_on_signals(worker.stopping)
    try:
        worker.run()
    finally:
        telemetry.shutdown()  # what the exporter still holds


def main() -> None:
    parser = argparse.ArgumentParser(description="Run one inference worker from a spec.")
    parser.add_argument("--spec", required=True, help="DeploymentSpec as JSON")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL",
                                                              "redis://127.0.0.1:6379/0"))
    parser.add_argument("--reclaim-after-ms", type=int, default=None)
    args = parser.parse_args()
    # An upstream worker opens its sealed API key with the project's SECRET_KEY.
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sluice.settings.base")
    logging.basicConfig(level=os.environ.get("SLUICE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    serve(DeploymentSpec.from_json(args.spec), args.redis_url,
          reclaim_after_ms=args.reclaim_after_ms)


if __name__ == "__main__":
    main()
