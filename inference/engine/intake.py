"""The intake: the entries a worker reads from its deployment's streams, and what it
holds of them until they run.

Reading: one XREADGROUP over every stream that holds requests (the list is re-read at
most every _IDLE_POLL_S), a fair share of the free room from each, so a tenant's flood
cannot hide another tenant's request. Idle, the worker blocks for the first request
(bounded, so a new tenant's stream shows soon); mid-batch it reads without blocking,
only when its backlog cannot fill the free slots, at most every max_wait_ms, so that
what arrives meanwhile joins the running batch together.

Lanes (placement by prefix, inference/routing.py `lane`): a stream in another live
worker's lane is not read as it comes; its entries are taken (`_steal`) once the oldest
new one has waited LANE_STEAL_MS (that worker is busy). The lanes of a worker that is
not live (no fresh heartbeat) are read like the shared streams.

When that rule reads nothing (a full batch, or a backlog that fills it), every
_IDLE_POLL_S it reads one entry from each stream of a tenant absent from the backlog,
past the window if need be, so the scheduler sees every waiting tenant and can share
the batch among them.

Holding: the entries read and not yet admitted are the `backlog` (a paused request
goes back to it, ahead of its tenant's others: `requeue`). Every third of
`reclaim_after_ms` the worker refreshes the idle time of the entries it holds (so no
reaper takes them), and takes over the entries idle longer than that (their worker is
dead): to its backlog, or, past `max_deliveries`, to the dead-letter stream (the
caller answers them). It hands entries back (`release`) when it stops or fails.

Also here: the cancel flags of the requests held, and what an earlier delivery of a
request already streamed (`streamed`: where a takeover resumes).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from inference import queue as q
from inference.engine.entries import Pending
from inference.jobs import DeltaEvent, Event, FinalEvent
from inference.spec import DeploymentSpec

logger = logging.getLogger("sluice.worker")
_RELEASE_IDLE_MS = 10**9  # "idle forever": the next reaper takes it at once
_IDLE_POLL_S = 0.05  # how often the list of streams is read (a new one shows within 2x)
_CANCEL_CHECK_S = 0.05  # how often cancellations are looked up (bounds their latency)
_CLEANUP_S = 60.0  # an empty stream is forgotten after one to two of these
# How long an entry waits in a live worker's lane before another worker takes it.
LANE_STEAL_MS = 250


@dataclass
class Streamed:
    """What earlier deliveries of a request wrote to its stream: its delta events, in
    order, and its final event if one finished it."""

    deltas: list[DeltaEvent] = field(default_factory=list)
    final: FinalEvent | None = None


@dataclass
class Cancelled:
    """Cancelled requests: entries taken out of the backlog, and running request ids."""

    waiting: list[Pending]
    running: list[str]


class Intake:
    def __init__(self, spec: DeploymentSpec, client: redis.Redis, worker_id: str, *,
                 reclaim_after_ms: int, stopping: threading.Event) -> None:
        self.spec = spec
        self.redis = client
        self.worker_id = worker_id
        # Entries idle longer than this belong to a dead worker and may be taken over.
        # It must sit above the p99 batch time: live workers refresh their own entries
        # every third of it.
        self.reclaim_after_ms = reclaim_after_ms
        self.window = spec.max_batch_size * 2  # the most entries held, running or not
        self.stopping = stopping
        self.backlog: list[Pending] = []
        self._cleanup = client.register_script(q.CLEANUP_LUA)
        # Monotonic due times: the loop calls maintain() and cancellations() once
        # these have passed.
        self.next_maintenance = 0.0
        self.next_cancel_check = 0.0
        self._next_reap = 0.0
        self._next_cleanup = time.monotonic() + _CLEANUP_S
        self._idle_seen: set[str] = set()
        self._streams_seen: list[str] = []  # the deployment's streams, as last read
        self._streams_fresh_until = 0.0
        self._next_join_read = 0.0  # a running batch's next read for newcomers
        self._next_absent_read = 0.0  # the next read for tenants absent from the backlog
        # The other live workers (the loop sets it from heartbeats): their lanes are read
        # only for entries that waited LANE_STEAL_MS; a dead one's lane is anyone's.
        self.others: frozenset[str] = frozenset()
        self._next_steal = 0.0

    def key(self, suffix: str) -> str:
        return q.stream_key(self.spec.name, suffix)

    def streams(self) -> list[str]:
        """The suffixes of the streams that hold requests right now."""
        return [_s(s) for s in self.redis.hkeys(q.streams_key(self.spec.name))]

    # -- reading -------------------------------------------------------------------
    def read(self, room: int, block_ms: int | None) -> list[Pending]:
        """New entries from every non-empty stream at once, a fair share of `room`
        each; `block_ms` bounds the wait for the first (None: no wait)."""
        now = time.monotonic()
        if now >= self._streams_fresh_until:
            self._streams_seen = self.streams()
            # The list is reused for _IDLE_POLL_S, blocking reads included (a read per
            # decode step or per wave of requests would otherwise cost two round trips):
            # a new tenant's stream shows within 2 x _IDLE_POLL_S at worst.
            self._streams_fresh_until = now + _IDLE_POLL_S
        suffixes = self._mine(self._streams_seen)
        theirs = [s for s in self._streams_seen if q.suffix_lane(s) in self.others]
        got: list[Pending] = []
        if suffixes:
            per_stream = max(1, room // len(suffixes))
            # A new tenant's stream is not among those we block on: bound the block so
            # the list is read again soon.
            block = min(block_ms, int(_IDLE_POLL_S * 1000)) if block_ms else None
            got = self._read_new(suffixes, per_stream, block)
        elif block_ms:
            time.sleep(_IDLE_POLL_S)
        if theirs and len(got) < room:
            got += self._steal(theirs, room - len(got))
        return got

    def _mine(self, suffixes: list[str]) -> list[str]:
        """The streams this worker reads as they come: the tenants' shared streams, its
        own lanes, and the lanes of workers that are not live."""
        return [s for s in suffixes if q.suffix_lane(s) not in self.others]

    def _read_new(self, suffixes: list[str], count: int, block: int | None) -> list[Pending]:
        try:
            reply = self.redis.xreadgroup(q.GROUP, self.worker_id,
                                          {self.key(s): ">" for s in suffixes},
                                          count=count, block=block)
        except redis.ResponseError as exc:
            # A stream emptied and went away meanwhile (before or during our block).
            if "NOGROUP" in str(exc) or "UNBLOCKED" in str(exc):
                self._streams_fresh_until = 0.0
                return []
            raise
        return self._entries(reply)

    def _steal(self, lanes: list[str], room: int) -> list[Pending]:
        """New entries of other live workers' lanes whose oldest waited LANE_STEAL_MS or
        more (their worker is busy: the load stays balanced), at most every
        _IDLE_POLL_S: a group's last delivered id, then the entry after it."""
        now = time.monotonic()
        if now < self._next_steal:
            return []
        self._next_steal = now + _IDLE_POLL_S
        pipe = self.redis.pipeline(transaction=False)
        for suffix in lanes:
            pipe.xinfo_groups(self.key(suffix))
        behind: list[tuple[str, str]] = []
        for suffix, groups in zip(lanes, pipe.execute(raise_on_error=False), strict=True):
            for group in groups if isinstance(groups, list) else ():
                lag = group.get("lag")
                # lag is None where Redis cannot count it (entries were deleted)
                if _s(group["name"]) == q.GROUP and (lag is None or lag > 0):
                    behind.append((suffix, _s(group["last-delivered-id"])))
        if not behind:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for suffix, last in behind:
            pipe.xrange(self.key(suffix), min=f"({last}", count=1)
        cutoff = q.now_ms() - LANE_STEAL_MS
        due = [suffix for (suffix, _), first in zip(behind, pipe.execute(), strict=True)
               if first and int(_s(first[0][0]).split("-")[0]) <= cutoff]
        return self._read_new(due, max(1, room // len(due)), None) if due else []

    def _entries(self, reply: Any) -> list[Pending]:
        out = []
        prefix = len(self.key(""))
        for stream, entries in reply or []:
            suffix = _s(stream)[prefix:]
            for msg_id, fields in entries:
                out.append(Pending(suffix, _s(msg_id), q.QueuedRequest.from_fields(fields)))
        return out

    def pull(self, *, running: int, block_ms: int, in_rotation: bool = True,
             others_in_rotation: bool = False, gather: bool = False) -> None:
        """Add new entries to the backlog, as the module docstring says, for a worker
        with `running` rows. Out of rotation (memory above the high-water mark) it takes
        nothing new while another worker is in rotation; when none is, it serves at a
        quarter of its batch size (the gateways degrade meanwhile) rather than leave the
        queue to time out. `gather`: an idle worker's first read waits up to max_wait_ms
        for a fuller batch (an embedding batch, which nothing can join later)."""
        backlog = self.backlog
        room = self.window - len(backlog) - running
        if room <= 0:
            now = time.monotonic()
            if in_rotation and now >= self._next_absent_read:
                self._next_absent_read = now + _IDLE_POLL_S
                backlog += self.read_absent()
            return
        if not in_rotation:
            room = min(room, max(1, self.spec.max_batch_size // 4) - running - len(backlog))
            if others_in_rotation or room <= 0:
                if not running and not backlog:
                    self.stopping.wait(_IDLE_POLL_S)
                return
        if running or backlog:
            now = time.monotonic()
            if len(backlog) < self.spec.max_batch_size - running \
                    and now >= self._next_join_read:
                self._next_join_read = now + self.spec.max_wait_ms / 1000
                backlog += self.read(room, None)  # never block a running batch
            elif now >= self._next_absent_read:
                self._next_absent_read = now + _IDLE_POLL_S
                backlog += self.read_absent()
            return
        got = self.read(room, block_ms)
        if not got:
            return
        self._next_join_read = time.monotonic() + self.spec.max_wait_ms / 1000
        # Chat generation is continuous: a lone request starts at once, and what arrives
        # within max_wait_ms joins its batch at the next read above (vLLM's and TGI's
        # way; waiting here cost every request at low load the whole window).
        # The wait is ours, then one read that does not block: Redis times a blocking
        # read out on its own clock tick (up to 100 ms at its default hz), so a
        # millisecond BLOCK would cost an idle deployment ~30-100 ms per request.
        if gather and self.spec.max_wait_ms > 0 \
                and len(got) < min(self.spec.max_batch_size, room):
            time.sleep(self.spec.max_wait_ms / 1000)
            got += self.read(room - len(got), None)
        backlog += got

    def read_absent(self) -> list[Pending]:
        """One entry from each stream whose tenant has nothing in the backlog (at most
        max_batch_size of them), whatever the room: a full backlog of one tenant's
        flood must not hide another tenant's request from the scheduler, which shares
        the running slots only among the tenants it sees."""
        present = {p.tenant for p in self.backlog}
        now = time.monotonic()
        if now >= self._streams_fresh_until:
            self._streams_seen = self.streams()
            self._streams_fresh_until = now + _IDLE_POLL_S
        absent = [s for s in self._mine(self._streams_seen)
                  if q.suffix_tenant(s) not in present]
        absent = absent[:self.spec.max_batch_size]
        if not absent:
            return []
        try:
            reply = self.redis.xreadgroup(q.GROUP, self.worker_id,
                                          {self.key(s): ">" for s in absent}, count=1)
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):
                self._streams_fresh_until = 0.0
                return []
            raise
        return self._entries(reply)

    def requeue(self, pending: Pending) -> None:
        """Put a paused request back in the backlog, ahead of its tenant's other
        entries of its priority (it was admitted before them)."""
        backlog = self.backlog
        at = next((i for i, p in enumerate(backlog)
                   if p.tenant == pending.tenant and p.priority == pending.priority),
                  len(backlog))
        backlog.insert(at, pending)

    def take(self, pendings: Iterable[Pending]) -> None:
        """Take entries out of the backlog (they run, or are answered)."""
        for pending in pendings:
            self.backlog.remove(pending)

    # -- holding -------------------------------------------------------------------
    def maintain(self, now: float, running: Iterable[Pending]) -> list[Pending]:
        """The periodic work, due at `next_maintenance` (`now`: monotonic): every third
        of reclaim_after_ms,
        refresh the claims of the backlog and of `running`, then reap; every
        _CLEANUP_S, forget empty streams. Returns the entries dead-lettered now: each
        needs its error event and acknowledgement from the caller."""
        dead: list[Pending] = []
        if now >= self._next_reap:
            self.refresh([*self.backlog, *running])
            dead = self.reap()
            self._next_reap = now + self.reclaim_after_ms / 3000
        if now >= self._next_cleanup:
            self.forget_empty_streams()
            self._next_cleanup = now + _CLEANUP_S
        self.next_maintenance = min(self._next_reap, self._next_cleanup)
        return dead

    def refresh(self, mine: Iterable[Pending]) -> None:
        """Reset the idle time of our own entries so no reaper mistakes us for dead."""
        for suffix, ids in _by_stream(mine).items():
            self.redis.xclaim(self.key(suffix), q.GROUP, self.worker_id, 0, ids, justid=True)

    def reap(self) -> list[Pending]:
        """Take over entries whose worker died (idle past reclaim_after_ms): to the
        backlog, or, delivered more than max_deliveries times, to the dead-letter
        stream; returns the latter."""
        claimed: list[tuple[str, str, Any]] = []
        for suffix in self.streams():
            try:
                reply = self.redis.xautoclaim(self.key(suffix), q.GROUP, self.worker_id,
                                              min_idle_time=self.reclaim_after_ms,
                                              start_id="0-0", count=self.window)
            except redis.ResponseError as exc:
                if "NOGROUP" in str(exc):
                    continue
                raise
            claimed += [(suffix, _s(i), f) for i, f in reply[1] if f]
        if not claimed:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for suffix, msg_id, _ in claimed:
            pipe.xpending_range(self.key(suffix), q.GROUP, min=msg_id, max=msg_id, count=1)
        counts = pipe.execute()
        dead = []
        for (suffix, msg_id, fields), info in zip(claimed, counts, strict=True):
            pending = Pending(suffix, msg_id, q.QueuedRequest.from_fields(fields),
                              int(info[0]["times_delivered"]) if info else 1)
            if pending.deliveries > self.spec.max_deliveries:
                self.dead_letter(pending)
                dead.append(pending)
            else:
                logger.warning("took over request %s (delivery %d)", pending.req.rid,
                               pending.deliveries)
                self.backlog.append(pending)
        return dead

    def dead_letter(self, pending: Pending) -> None:
        """Copy an entry to the dead-letter stream (its answer is the caller's)."""
        fields = {**pending.req.fields(), "deliveries": str(pending.deliveries),
                  "worker": self.worker_id, "at": str(q.now_ms())}
        self.redis.xadd(q.dead_key(self.spec.name), fields, maxlen=10_000, approximate=True)
        logger.error("request %s dead-lettered after %d deliveries", pending.req.rid,
                     pending.deliveries)

    def release(self, pendings: Iterable[Pending], *, failed: bool = False) -> None:
        """Hand entries back. XCLAIM with a huge IDLE makes them look abandoned: the
        next reaper of any live worker takes them over at once (and resumes their
        output). Unless `failed` (they were in a batch that failed), their delivery
        count is set back by the delivery that did not run to its end, so a request
        only nears `max_deliveries` (the dead letters) by failing, not by waiting in
        the backlog of a worker that failed or stopped."""
        groups: dict[tuple[str, int], list[str]] = {}
        for pending in pendings:
            count = pending.deliveries if failed else max(0, pending.deliveries - 1)
            groups.setdefault((pending.stream, count), []).append(pending.msg_id)
        for (suffix, count), ids in groups.items():
            self.redis.xclaim(self.key(suffix), q.GROUP, "released", 0, ids,
                              idle=_RELEASE_IDLE_MS, justid=True, retrycount=count)

    def forget_empty_streams(self) -> None:
        """Streams at zero on two calls in a row go (new requests recreate them): the
        loop calls this every _CLEANUP_S."""
        counts = {_s(k): int(v) for k, v in self.redis.hgetall(
            q.streams_key(self.spec.name)).items()}
        for suffix in [s for s, n in counts.items() if n <= 0 and s in self._idle_seen]:
            self._cleanup(keys=[self.key(suffix), q.streams_key(self.spec.name)],
                          args=[suffix])
        self._idle_seen = {s for s, n in counts.items() if n <= 0}

    # -- cancellation and resumption ----------------------------------------------
    def cancellations(self, now: float, running: Iterable[str]) -> Cancelled | None:
        """At most every _CANCEL_CHECK_S (`now`: monotonic), the requests of the backlog
        and of `running` whose callers cancelled them; the waiting ones leave the
        backlog. None when nothing was looked up or nothing is cancelled."""
        if now < self.next_cancel_check:
            return None
        self.next_cancel_check = now + _CANCEL_CHECK_S
        running = list(running)
        rids = [p.req.rid for p in self.backlog] + running
        if not rids:
            return None
        flags = self.redis.smismember(q.cancel_key(self.spec.name), rids)
        cancelled = {rid for rid, flag in zip(rids, flags, strict=True) if flag}
        if not cancelled:
            return None
        waiting = [p for p in self.backlog if p.req.rid in cancelled]
        self.take(waiting)
        return Cancelled(waiting, [rid for rid in running if rid in cancelled])

    def streamed(self, req: q.QueuedRequest) -> Streamed:
        """What earlier deliveries of `req` already wrote to its stream."""
        found = Streamed()
        for _id, fields in self.redis.xrange(q.out_key(req.tenant, req.rid)):
            event = cast(Event, json.loads(fields[b"e"]))
            if event["t"] == "done" or event["t"] == "error":
                found.final = event
                break
            if event["t"] == "delta":
                found.deltas.append(event)
        return found


def _by_stream(pendings: Iterable[Pending]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for pending in pendings:
        out.setdefault(pending.stream, []).append(pending.msg_id)
    return out


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
