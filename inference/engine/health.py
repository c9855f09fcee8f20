"""A worker's health: its heartbeat, its memory guard, its batch spans.

Heartbeat: every `heartbeat_s` the worker writes one JSON value under its id in the
deployment's `:workers` hash (the autoscaler, the gateways' admission and /metrics read
it), with these fields:
  ts, pid, kind          when, which process, the deployment's kind
  batch, backlog, load   rows running, entries waiting here, and their sum
  max_batch              the deployment's max_batch_size
  mem_used, mem_total    the runtime's memory reading (bytes)
  batches                batches admitted since the worker started
  in_rotation            the memory guard's verdict (inference/engine/memory.py)
  kv_capacity_tokens     the runtime's KV cache capacity in tokens, when it sets one,
  kv_used_tokens         and the tokens it holds now
  prefix_cache_*         the prefix cache's pool and counters, when the runtime has one
                         (blocks, capacity_blocks, block_tokens, lookups, hits,
                         hit_tokens, evictions: inference/runtimes/prefix_cache.py)
The same round trip adds the batch sizes admitted since the last beat to the
deployment's histogram, reads the guard's thresholds for the next beat, and learns
whether any other live worker is in rotation (a worker out of rotation keeps serving a
little when none is).

Spans: each admitted batch is one `inference.batch` span, linked to the span of every
request it serves (their traceparents travel in the queue entry); it ends when the last
of its requests is served, or when the worker gives its work up (`end_batches`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import redis
from opentelemetry.trace import Link, Span, SpanKind

from inference import queue as q
from inference.engine.entries import Pending
from inference.engine.memory import MemoryGuard
from inference.spec import DeploymentSpec
from sluice.observability import telemetry


class Measured(Protocol):
    """What health reads of a worker's runtime: its memory, (used, total) bytes (a
    runtime may also set `kv_capacity_tokens` and `kv_used_tokens()`: see above)."""

    def memory(self) -> tuple[int, int]: ...


@dataclass
class BatchSpan:
    """A batch's span: open until the last request it admitted has its final event."""

    span: Span
    open: set[str]


class Health:
    def __init__(self, spec: DeploymentSpec, client: redis.Redis, worker_id: str,
                 runtime: Measured, *, heartbeat_s: float) -> None:
        self.spec = spec
        self.redis = client
        self.worker_id = worker_id
        self.runtime = runtime
        self.heartbeat_s = heartbeat_s
        self.guard = MemoryGuard()
        self.others_in_rotation = False
        self.others_live: frozenset[str] = frozenset()  # the other live workers' ids
        self.batches = 0
        self.batch_sizes: dict[int, int] = {}  # not yet reported (the next beat sends them)
        self.next_beat = 0.0  # monotonic: when the loop beats next
        self._batch_of: dict[str, BatchSpan] = {}

    # -- heartbeats ----------------------------------------------------------------
    def beat_if_due(self, now: float, *, batch: int, backlog: int) -> None:
        """Beat if `next_beat` has passed (`now`: monotonic)."""
        if now >= self.next_beat:
            self.beat(now, batch=batch, backlog=backlog)

    def beat(self, now: float, *, batch: int, backlog: int) -> None:
        """One heartbeat (the fields are in the module docstring); the next is due at
        `next_beat` (`now`: monotonic)."""
        self.next_beat = now + self.heartbeat_s
        key = q.workers_key(self.spec.name)
        guard = {_s(k): _s(v) for k, v in self.redis.hgetall(q.guard_key(self.spec.name)).items()}
        with contextlib.suppress(KeyError, ValueError):
            self.guard.configure(high=float(guard["high"]), low=float(guard["low"]),
                                 hold_s=float(guard["hold_s"]))
        used, total = self.runtime.memory()
        in_rotation = self.guard.observe(used, total, time.monotonic())
        beat: dict[str, Any] = {
            "ts": time.time(), "pid": os.getpid(), "kind": self.spec.kind.value,
            "batch": batch, "backlog": backlog, "load": batch + backlog,
            "max_batch": self.spec.max_batch_size, "mem_used": used, "mem_total": total,
            "batches": self.batches, "in_rotation": in_rotation}
        # A runtime without a bound of its own (or one that predates the attribute)
        # reports neither.
        capacity = getattr(self.runtime, "kv_capacity_tokens", None)
        if isinstance(capacity, int):
            beat["kv_capacity_tokens"] = capacity
            kv_used = getattr(self.runtime, "kv_used_tokens", None)
            if callable(kv_used):
                beat["kv_used_tokens"] = int(kv_used())
        prefix_stats = getattr(self.runtime, "prefix_stats", None)
        if callable(prefix_stats):
            beat.update(prefix_stats())
        pipe = self.redis.pipeline(transaction=False)
        sizes, self.batch_sizes = self.batch_sizes, {}
        for size, count in sizes.items():  # the /metrics batch-size histogram
            pipe.hincrby(q.batch_sizes_key(self.spec.name), str(size), count)
        pipe.hset(key, self.worker_id, json.dumps(beat))
        pipe.expire(key, 60)
        pipe.hgetall(key)
        *_, beats = pipe.execute()
        others = {k: b for k, b in q.live_heartbeats(beats).items() if k != self.worker_id}
        self.others_in_rotation = any(b.get("in_rotation", True) for b in others.values())
        self.others_live = frozenset(others)

    def leave(self) -> None:
        """Remove this worker's heartbeat (it stops serving)."""
        self.redis.hdel(q.workers_key(self.spec.name), self.worker_id)

    # -- spans ---------------------------------------------------------------------
    def open_batch(self, chosen: Sequence[Pending]) -> None:
        """Count an admitted batch and open its span."""
        self.batches += 1
        size = len(chosen)
        self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1
        links = [Link(ctx) for p in chosen
                 if (ctx := telemetry.span_context_of(p.req.traceparent)) is not None]
        span = telemetry.tracer.start_span("inference.batch", kind=SpanKind.CONSUMER,
                                           links=links, attributes={
                                               "sluice.deployment": self.spec.name,
                                               "sluice.worker": self.worker_id,
                                               "sluice.batch.size": size,
                                               "sluice.batch.number": self.batches})
        batch = BatchSpan(span, {p.req.rid for p in chosen})
        for pending in chosen:
            self.served(pending.req.rid)  # a paused request leaves its earlier batch
            self._batch_of[pending.req.rid] = batch

    def served(self, rid: str) -> None:
        """`rid` has its final event: its batch's span ends if it was the last one."""
        batch = self._batch_of.pop(rid, None)
        if batch is not None:
            batch.open.discard(rid)
            if not batch.open:
                batch.span.end()

    def end_batches(self, reason: str) -> None:
        """End every open batch span (the worker gave its work up: `reason`)."""
        for batch in {id(b): b for b in self._batch_of.values()}.values():
            batch.span.set_attribute("sluice.batch.ended", reason)
            batch.span.end()
        self._batch_of.clear()


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
