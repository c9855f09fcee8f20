"""Everything a finished call reports, written to Redis off the response path.

Per-call work (a settlement: the quota charge and the usage counts for billing; a
token-bucket correction; a probe's verdict) is queued and written by one flusher task
per gateway process, in one pipeline with whatever else is pending ("group commit":
under load, hundreds of calls share a round trip). A probe's verdict is written within
a round trip of its call's end, the rest within FLUSH_S. The settlements of a tenant's
calls with the same quotas (or none) go in one script call (each request is still
charged once, by its id); token-bucket corrections are summed per bucket and written in
one script call per tenant: the buckets' levels are the same as with one call per
request (a forced debit has no check; only a refund to a bucket that is already full
differs, by the part the cap would have cut). Counters that only need totals are summed
in-process and written at most every FLUSH_S: usage counted apart from a settlement
(`count_usage`), the latency histograms of the adaptive limits, and the outcomes that
feed the breakers (one script call per deployment per flush, so a breaker reacts within
FLUSH_S).
Audit events ride along: appended to the audit stream with each flush.

A gateway that crashes loses at most FLUSH_S of these counters and audit events; its
open reservations expire at their deadline. A flush that fails because Redis is away
(restart, failover) is kept and retried with the next one, for up to RETRY_FOR_S or
MAX_HELD_AUDIT audit events (then dropped, logged); never a call. A flush that Redis
applied but whose reply was lost is harmless to retry: a call's settlement (its quota
charge and usage counts) is charged once per request id, whichever gateway settles the
request first (quota.SETTLE_LUA); other usage counts, token-bucket corrections, latency
histograms and breaker outcomes are applied once per flush number (a mark per tenant, or
per deployment, and gateway process); and audit events carry their own id, which the
audit writer stores once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from secrets import token_hex
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from governance import alerts, audit, breaker, quota, ratelimit, signals, usage
from governance.models import BreakerPolicy, Budget
from inference.queue import deployment_key
from sluice.redis import ScriptBatch, chunks

logger = logging.getLogger("sluice.governance")
FLUSH_S = 0.1
RETRY_FOR_S = 60.0  # how long a failed flush is kept for retrying
MAX_HELD_AUDIT = 100_000  # audit events held while Redis is away, at most
PER_CALL = 500  # settlements, or buckets, per script call (bounds how long it holds Redis)
# A flush's corrections to one tenant's token buckets ("force": no check), applied once
# however often the flush is retried. Its script calls are marked flush * _MARKS + i.
CORRECT_LUA = usage.ONCE_PER_FLUSH_LUA + ratelimit.BUCKETS_LUA
_MARKS = 1_000_000
# A flush's latency histogram of one deployment and metric, and its breaker outcomes of
# one deployment: each applied once however often the flush is retried (a doubled
# failure count could open a breaker).
LATENCIES_LUA = usage.ONCE_PER_FLUSH_LUA + signals.ADD_LUA
OUTCOMES_LUA = usage.ONCE_PER_FLUSH_LUA + breaker.RECORD_LUA


def deployment_mark(deployment: str, writer: str, what: str) -> str:
    """A writer's mark (usage.applied_key) for what it writes in a deployment's slot."""
    return deployment_key(deployment, f"{what}:applied:{writer}")

# A queued per-call write: (Lua source, keys, args).
Write = tuple[str, list[str], list[Any]]


@dataclass
class _Pending:
    # This flush's number (in order, per recorder): Redis adds its usage counts once.
    number: int
    writes: list[Write] = field(default_factory=list)
    # (flush number, tenant) -> (model, key prefix) -> [requests, prompt, completion]
    usage: dict[tuple[int, str], dict[tuple[str, str], list[int]]] = field(
        default_factory=dict)
    # (flush number, deployment, metric) -> latency bucket -> calls
    latency: dict[tuple[int, str, str], dict[int, int]] = field(default_factory=dict)
    # (flush number, deployment) -> (its breaker policy, the calls' outcomes)
    outcomes: dict[tuple[int, str], tuple[BreakerPolicy, list[breaker.Call]]] = field(
        default_factory=dict)
    audit: list[str] = field(default_factory=list)
    # (tenant, the quotas' keys) -> (the quotas, their calls' settlements)
    settlements: dict[tuple[str, tuple[str, ...]],
                      tuple[list[quota.Metered], list[quota.Settlement]]] = field(
                          default_factory=dict)
    # (flush number, tenant) -> bucket key -> (the bucket, the sum of its corrections)
    buckets: dict[tuple[int, str], dict[str, tuple[ratelimit.Bucket, float]]] = field(
        default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.writes or self.usage or self.latency or self.outcomes or self.audit
                    or self.settlements or self.buckets)

    def settle(self, tenant: str, quotas: list[quota.Metered],
               settlement: quota.Settlement) -> None:
        group = (tenant, tuple(quota.keys_for(tenant, quotas)))
        self.settlements.setdefault(group, (quotas, []))[1].append(settlement)

    def correct(self, number: int, tenant: str, bucket: ratelimit.Bucket,
                cost: float) -> None:
        mine = self.buckets.setdefault((number, tenant), {})
        _, total = mine.get(bucket.key, (bucket, 0.0))
        mine[bucket.key] = (bucket, total + cost)

    def describe(self) -> str:
        """What this flush carries, for the log lines of one that is lost."""
        return (f"{len(self.writes)} writes, {len(self.settlements)} quota settlement "
                f"groups, {len(self.buckets)} tenants' bucket corrections and "
                f"{len(self.audit)} audit events")

    def merge(self, later: _Pending) -> _Pending:
        """This (failed, older) flush followed by `later`, as one. Usage counts, bucket
        corrections, latencies and outcomes keep their flush numbers: the failed
        flush's may have been applied with only the reply lost, and are then skipped,
        while `later`'s still count.
        What is recorded from now on goes under `later`'s number (under this one's, it
        would be skipped with it)."""
        self.number = later.number
        self.writes += later.writes
        self.usage.update(later.usage)
        self.latency.update(later.latency)
        self.outcomes.update(later.outcomes)
        self.audit += later.audit
        for group, (quotas, settled) in later.settlements.items():
            self.settlements.setdefault(group, (quotas, []))[1].extend(settled)
        for (number, tenant), corrections in later.buckets.items():
            for held, cost in corrections.values():
                self.correct(number, tenant, held, cost)
        return self


class Recorder:
    def __init__(self, redis: Any, on_open: Callable[[str], None]) -> None:
        self.redis = redis
        self._on_open = on_open
        self.writer = token_hex(8)  # names this recorder's flushes in Redis (usage.count)
        self._flushes = itertools.count()
        self._pending = _Pending(next(self._flushes))
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._failing_since: float | None = None  # when the held flush first failed

    # -- what calls report -------------------------------------------------------------
    def write(self, script: str, keys: list[str], args: list[Any]) -> None:
        self._pending.writes.append((script, keys, args))
        self._flush_soon()

    def settle(self, tenant: str, quotas: list[quota.Metered],
               settlement: quota.Settlement) -> None:
        """Settle a call: release its reservation of `quotas` (if any) and charge its
        request (quota.SETTLE_LUA: once per request id, usage counters included)."""
        self._pending.settle(tenant, quotas, settlement)
        self._flush_soon()

    def correct_buckets(self, tenant: str, buckets: list[ratelimit.Bucket],
                        cost: float) -> None:
        """Debit (or, negative, refund) each of a tenant's token buckets `cost` regardless
        of its level: a call's real usage against the estimate it was charged."""
        pending = self._pending
        for bucket in buckets:
            pending.correct(pending.number, tenant, bucket, cost)
        self._flush_soon()

    def count_usage(self, *, tenant: str, model: str, key_prefix: str, prompt: int,
                    completion: int) -> None:
        rows = self._pending.usage.setdefault((self._pending.number, tenant), {})
        row = rows.setdefault((model, key_prefix), [0, 0, 0])
        row[0] += 1
        row[1] += prompt
        row[2] += completion
        self._ensure_running()

    def latency(self, deployment: str, ms: float, metric: str = "lat") -> None:
        """A call's latency ("lat") or time to first token ("ttft"), see signals.py."""
        pending = self._pending
        histogram = pending.latency.setdefault((pending.number, deployment, metric), {})
        bucket = signals.bucket_of(ms)
        histogram[bucket] = histogram.get(bucket, 0) + 1
        self._ensure_running()

    def audit(self, event: dict[str, Any]) -> None:
        """An audit event, appended to the audit stream with the next flush. It carries
        its own `source` id, so that a retried flush that Redis had applied stores it
        once (the writer skips a source it has)."""
        self._pending.audit.append(audit.to_wire({**event, "source": audit.new_source()}))
        self._ensure_running()

    def outcome(self, deployment: str, policy: BreakerPolicy, outcome: breaker.Outcome,
                ms: float, tenant: str = "") -> None:
        """A call's outcome for the deployment's breaker, counted for `tenant` (one tenant
        alone never opens it for everyone; "" is no one tenant's: breaker.py)."""
        pending = self._pending
        _, calls = pending.outcomes.setdefault((pending.number, deployment), (policy, []))
        calls.append((outcome, ms, tenant))
        self._ensure_running()

    # -- flushing ----------------------------------------------------------------------
    def _flush_soon(self) -> None:
        """A per-call write is pending: wake the flusher, which writes a probe's verdict
        at once and settlements and corrections within FLUSH_S (see `_run`)."""
        self._ensure_running()
        self._wake.set()

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="sluice-governance-recorder")

    async def _run(self) -> None:
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FLUSH_S):
                    await self._wake.wait()
            self._wake.clear()
            if not self._pending.writes:
                # Counters only: let them gather for the rest of the interval.
                await asyncio.sleep(FLUSH_S)
            await self.flush()

    async def flush(self) -> None:
        pending, self._pending = self._pending, _Pending(next(self._flushes))
        if not pending:
            return
        batch = ScriptBatch(self.redis)
        pipe = batch.pipe
        for script, keys, args in pending.writes:
            batch.script(script, keys, args)
        charged = set()
        budgeted: list[tuple[int, str, list[quota.Metered]]] = []  # reply index, tenant
        for (tenant, _keys), (quotas, settled) in pending.settlements.items():
            for run in chunks(settled, PER_CALL):
                if any(isinstance(q, Budget) for q in quotas):
                    budgeted.append((len(batch), tenant, quotas))
                batch.script(quota.SETTLE_LUA, *quota.settle_call(tenant, quotas, run))
            if any(s.requests for s in settled):
                charged.add(tenant)
        usage.index(batch, charged)
        # A tenant's buckets share a slot; the oldest flush's first (the marks' order).
        for (number, tenant), corrections in sorted(pending.buckets.items()):
            due = [(bucket, cost) for bucket, cost in corrections.values() if cost]
            for i, part in enumerate(chunks(due, PER_CALL)):
                buckets = [bucket for bucket, _cost in part]
                batch.script(CORRECT_LUA, *usage.once_per_flush(
                    [b.key for b in buckets],
                    ratelimit.args_for(buckets, [c for _b, c in part], "force"),
                    mark=usage.applied_key(tenant, self.writer, "rl"),
                    flush=number * _MARKS + i))
        for (number, tenant), rows in sorted(pending.usage.items()):  # oldest flush first
            usage.count(batch, tenant=tenant, writer=self.writer, flush=number, rows=rows)
        for (number, deployment, metric), histogram in sorted(pending.latency.items()):
            batch.script(LATENCIES_LUA, *usage.once_per_flush(
                *signals.latencies_call(deployment, histogram, metric),
                mark=deployment_mark(deployment, self.writer, metric), flush=number))
        for wire in pending.audit:
            pipe.xadd(audit.STREAM, {"e": wire}, maxlen=audit.STREAM_MAXLEN, approximate=True)
        names = []
        for (number, name), (policy, calls) in sorted(pending.outcomes.items()):
            names.append(name)
            batch.script(OUTCOMES_LUA, *usage.once_per_flush(
                breaker.keys(name), breaker.record_args("", calls, policy),
                mark=deployment_mark(name, self.writer, "br"), flush=number))
        try:
            replies = await batch.run_async()
        except (RedisConnectionError, RedisTimeoutError):
            self._hold(pending)  # Redis away (restart, failover): try again with the next
            return
        except RedisError:  # a command refused: retrying would not help
            logger.exception("governance flush refused by Redis: %s lost", pending.describe())
            return
        if self._failing_since is not None:
            logger.warning("governance flush succeeded again after %.1f s",
                           time.monotonic() - self._failing_since)
            self._failing_since = None
        for name, reply in zip(names, replies[len(replies) - len(names):], strict=True):
            if reply == b"open":
                self._on_open(name)
        for index, tenant, quotas in budgeted:  # thresholds this flush's spend crossed
            for alert in alerts.fired(quotas, replies[index]):
                self.audit(alerts.event(alert, tenant))

    def _hold(self, failed: _Pending) -> None:
        """Keep a failed flush for the next one, within bounds."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
            logger.warning("governance flush failed (Redis); retrying with the next one",
                           exc_info=True)
        if now - self._failing_since > RETRY_FOR_S or len(failed.audit) > MAX_HELD_AUDIT:
            logger.error("governance flush failing for %.0f s: %s dropped",
                         now - self._failing_since, failed.describe())
            self._failing_since = now
            return
        self._pending = failed.merge(self._pending)
        self._ensure_running()

    async def close(self) -> None:
        """Write everything pending, then stop."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, RedisError):
                await self._task
        await self.flush()
