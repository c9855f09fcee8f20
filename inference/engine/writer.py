"""The writer: a step's events and acknowledgements, written to Redis off the loop's
thread, in order, each request's final event once.

The loop appends to an `Outbox` as it goes (events of any kind; a request's final event
together with its entry's acknowledgement) and hands it to `Writer.flush` once per
iteration. One write is in flight at a time, on the writer thread, so Redis I/O (and
the events' JSON encoding) overlaps the next decode step; with nothing running it is
written on the caller's thread instead.

What one write does (`Writer.write`), in as few round trips as it can:
- events first, acknowledgements after: a crash in between leaves the entry pending,
  and its next delivery resumes from (or just acknowledges) what was written;
- a request's final event (and its other events of the same step) is appended by
  FINALS_LUA, which sets the request's `done` marker (SET NX) in the same script: the
  first delivery to finish a request owns its one final event (one charge);
- every other event is appended by EVENTS_LUA, one call per tenant and chunk;
- the waiting gateway gets one message per write, with every event of the step;
- ACKS_LUA acknowledges the finished entries and releases their counts;
- a reply its job asks to keep (jobs.Keep: the Responses API's stored response) is
  kept by KEEP_LUA before the gateway's message, in the same round trip (on a cluster,
  in a round trip of its own before it): the events of such a request are gathered as
  they are written, and its `done` event, when this worker wrote every event of it,
  says `kept_at`.
A first delivery's finals are claimed in the same round trip, ownership presumed; a
redelivery asks first, and when another delivery finished the request, the gateway is
told the final that stands (this delivery's own events are dropped).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import redis

from inference import queue as q
from inference.engine.entries import Pending
from inference.jobs import FINAL_EVENTS, ChatJob, Event, FinalEvent, JobError, Keep, encode_event
from sluice.redis import ScriptBatch, chunks, is_cluster

logger = logging.getLogger("sluice.worker")

Outgoing = list[tuple[q.QueuedRequest, Event]]
_KEEPING_MAX = 100_000  # replies gathered at once, at most (the oldest are given up)


class _Keeping:
    """A reply being gathered to keep: its job's Keep, its encoded events so far, how
    many events it had, and whether they are all of its events from the first."""

    __slots__ = ("count", "events", "keep", "whole")

    def __init__(self, keep: Keep) -> None:
        self.keep = keep
        self.events: list[str] = []
        self.count = 0
        self.whole = True


class Outbox:
    """The events and acknowledgements of one iteration, in the order they were made.
    `served(rid)` is called when a request's entry is to be acknowledged (its final
    event, if any, is in the outbox): the batch span that holds it may end."""

    def __init__(self, served: Callable[[str], None] = lambda rid: None) -> None:
        self.events: Outgoing = []
        self.acks: list[Pending] = []
        self._served = served

    def __bool__(self) -> bool:
        return bool(self.events or self.acks)

    def add(self, req: q.QueuedRequest, event: Event) -> None:
        self.events.append((req, event))

    def final(self, pending: Pending, event: FinalEvent) -> None:
        """A request's last event; its entry is acknowledged after it is written."""
        self.events.append((pending.req, event))
        self.ack(pending)

    def ack(self, pending: Pending) -> None:
        """Acknowledge an entry with no event of this delivery (an earlier one wrote it)."""
        self.acks.append(pending)
        self._served(pending.req.rid)

    def take(self) -> tuple[Outgoing, list[Pending]]:
        """Everything appended so far; the outbox is empty after."""
        taken = self.events, self.acks
        self.events, self.acks = [], []
        return taken


class Writer:
    def __init__(self, client: redis.Redis, deployment: str, worker_id: str) -> None:
        self.redis = client
        self.deployment = deployment
        self.worker_id = worker_id
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-writer")
        self._writing: Future[None] | None = None
        self._cluster = is_cluster(client)
        self._keeping: dict[str, _Keeping] = {}  # by request id

    def flush(self, outbox: Outbox, *, background: bool, wait: bool = False) -> None:
        """Write what `outbox` holds: on the writer thread when `background` (a step
        runs meanwhile: torch releases the GIL while it computes), after the write in
        flight, so order is kept and a slow Redis slows the loop down; else on this
        thread (a handoff would only add a thread switch, up to the GIL's 5 ms switch
        interval while this thread runs on, to a lone request's latency). `wait`: return
        once everything handed over is written."""
        if outbox:
            self.wait()
            events, acks = outbox.take()
            if background:
                self._writing = self._thread.submit(self.write, events, acks)
            else:
                self.write(events, acks)
        if wait:
            self.wait()

    def wait(self) -> None:
        """Until the write in flight, if any, is done (its error is raised here)."""
        if self._writing is not None:
            writing, self._writing = self._writing, None
            writing.result()

    def abandon(self) -> None:
        """Let the write in flight end, ignoring its failure."""
        with contextlib.suppress(Exception):
            self.wait()
        self._writing = None

    def close(self, *, wait: bool) -> None:
        self._thread.shutdown(wait=wait)

    def resend(self, req: q.QueuedRequest, final: FinalEvent) -> None:
        """Tell the request's gateway its final event again, now (an earlier delivery
        wrote it and may have died before telling the gateway; a gateway that has it
        ignores the repeat)."""
        q.add_gateway_message(self.redis, req.gateway,
                              [q.gateway_item(req.rid, encode_event(final))])

    def write(self, outbox: Outgoing, acks: list[Pending]) -> None:
        """One step's events, then the acknowledgements of `acks` (see the module
        docstring); any thread, one call at a time."""
        keeping = self._gather(outbox)
        encoded = [(req, event, encode_event(event)) for req, event in outbox]
        kept = self._gathered(keeping, encoded)
        finishing: dict[str, tuple[q.QueuedRequest, list[str]]] = {
            req.rid: (req, []) for req, event, _data in encoded
            if event["t"] in FINAL_EVENTS}
        for req, _event, data in encoded:
            if req.rid in finishing:
                finishing[req.rid][1].append(data)
        owned: set[str] = set()
        stored: dict[str, str] = {}  # rid -> the final another delivery wrote
        batch = ScriptBatch(self.redis)
        presumed: list[list[str]] = []  # request ids per FINALS call, when presumed
        if finishing:
            first = {p.req.rid for p in acks if p.deliveries == 1}
            if first.issuperset(finishing):
                # First deliveries all: no other worker can have finished them unless
                # it took one over from this worker while this one lived on (a stall
                # past reclaim_after_ms). So the claims go in the same round trip as
                # the rest, ownership presumed; in that rare case the gateway may get
                # this worker's final as well as the owner's and keeps the first (one
                # reply, once), and the request's stream keeps the owner's.
                presumed = self._claims(batch, list(finishing.values()))
                owned = set(finishing)
            else:
                # A redelivery may find its request finished: ask first, then tell
                # the gateway the final that stands.
                claims = ScriptBatch(self.redis)
                calls = self._claims(claims, list(finishing.values()))
                replies = [reply for call in claims.run() for reply in call]
                for rid, reply in zip([r for c in calls for r in c], replies, strict=True):
                    if reply == 1:
                        owned.add(rid)
                    elif reply:
                        stored[rid] = _s(reply)
        kept = [(req, k) for req, k in kept if req.rid in owned]
        if kept and self._cluster:  # before the gateway hears of them: a round trip first
            keeps = ScriptBatch(self.redis)
            self._keep(keeps, kept, queue=False)
            keeps.run()
        by_gateway: dict[str, list[str]] = {}
        appends: dict[str, list[tuple[str, str, str]]] = {}  # tenant -> (stream, event, first)
        for req, event, data in encoded:
            if req.rid in finishing:
                if req.rid not in owned:
                    # Finished by another delivery: its events stand, and its final goes
                    # to the gateway again (which fills any gap from the request's stream
                    # and ignores a repeat); this delivery's own events are dropped.
                    if event["t"] not in FINAL_EVENTS or req.rid not in stored:
                        continue
                    data = stored[req.rid]
            else:
                appends.setdefault(req.tenant, []).append(
                    (q.out_key(req.tenant, req.rid), data, "1" if event["seq"] == 0 else "0"))
            by_gateway.setdefault(req.gateway, []).append(q.gateway_item(req.rid, data))
        for rows in appends.values():  # a tenant's streams share a cluster slot
            for chunk in chunks(rows, q.EVENTS_PER_CALL):
                batch.script(q.EVENTS_LUA, [stream for stream, _e, _f in chunk],
                             [q.OUT_TTL_S, *(x for _stream, event, first in chunk
                                             for x in (event, first))])
        if kept:
            self._keep(batch, kept, queue=True)
        # One message per gateway per step carries every event of the step.
        for gateway, items in by_gateway.items():
            q.add_gateway_message(batch.pipe, gateway, items)
        for done in chunks(acks, q.EVENTS_PER_CALL):
            batch.script(q.ACKS_LUA, q.ack_keys(self.deployment, [p.stream for p in done]),
                         [x for p in done for x in (p.req.tenant, p.stream, p.msg_id, p.req.rid)])
        replies = batch.run()
        if presumed:  # the FINALS calls went first
            for rids, call in zip(presumed, replies, strict=False):
                for rid, reply in zip(rids, call, strict=True):
                    if reply != 1:
                        logger.warning("request %s was finished by another worker too; "
                                       "the gateway kept the first final it got", rid)

    def _gather(self, outbox: Outgoing) -> dict[str, _Keeping]:
        """Start gathering the replies to keep whose first event is in `outbox`, mark
        each kept `done` event (`kept_at`: every event of the reply is this worker's);
        the replies gathered that have events in `outbox`."""
        touched: dict[str, _Keeping] = {}
        for req, event in outbox:
            keeping = self._keeping.get(req.rid)
            if keeping is None and event["seq"] == 0 and b'"keep"' in req.body:
                with contextlib.suppress(JobError):
                    job = req.job()
                    if isinstance(job, ChatJob) and job.keep is not None:
                        keeping = self._keeping[req.rid] = _Keeping(job.keep)
                        if len(self._keeping) > _KEEPING_MAX:  # finals that never came
                            del self._keeping[next(iter(self._keeping))]
            if keeping is None:
                continue
            touched[req.rid] = keeping
            keeping.whole = keeping.whole and event["seq"] == keeping.count
            keeping.count += 1
            if event["t"] == "done" and keeping.whole and event["finish"] != "cancelled":
                event["kept_at"] = int(time.time())
        return touched

    def _gathered(self, keeping: dict[str, _Keeping],
                  encoded: list[tuple[q.QueuedRequest, Event, str]]
                  ) -> list[tuple[q.QueuedRequest, _Keeping]]:
        """The gathered events' encodings filled in; the replies that end here kept
        (their gathering ends either way)."""
        kept = []
        if keeping:
            for req, event, data in encoded:
                k = keeping.get(req.rid)
                if k is None:
                    continue
                k.events.append(data)
                if event["t"] in FINAL_EVENTS:
                    self._keeping.pop(req.rid, None)
                    if "kept_at" in event:
                        kept.append((req, k))
        return kept

    def _keep(self, batch: ScriptBatch, kept: list[tuple[q.QueuedRequest, _Keeping]], *,
              queue: bool) -> None:
        """KEEP_LUA for each kept reply, which also queues it on a single Redis; on a
        cluster (the stream in a slot of its own) the copy (`queue` False) or the
        queueing (`queue`, KEEP_QUEUE_LUA)."""
        for req, k in kept:
            keep = k.keep
            fields: list[str | bytes] = ["draft", keep.draft,
                                         "reply", "[" + ",".join(k.events) + "]",
                                         "rid", req.rid]
            keys = [keep.key + req.rid, keep.deletions + req.rid]
            args = q.keep_args(keep.by, keep.ttl_s, keep.forget_s, keep.maxlen, fields)
            if not self._cluster:
                batch.script(q.KEEP_LUA, [*keys, keep.stream], args)
            elif queue:
                batch.script(q.KEEP_QUEUE_LUA, [keep.stream],
                             q.keep_queue_args(keep.by, keep.maxlen, fields))
            else:
                batch.script(q.KEEP_LUA, keys, args)

    def _claims(self, batch: ScriptBatch,
                finishing: list[tuple[q.QueuedRequest, list[str]]]) -> list[list[str]]:
        """FINALS_LUA calls for the finishing requests (one per tenant and chunk) added
        to `batch`; per call, its request ids in reply order."""
        by_tenant: dict[str, list[tuple[q.QueuedRequest, list[str]]]] = {}
        for req, events in finishing:
            by_tenant.setdefault(req.tenant, []).append((req, events))
        calls: list[list[str]] = []
        for group in by_tenant.values():
            for part in chunks(group, q.EVENTS_PER_CALL):
                calls.append([req.rid for req, _events in part])
                batch.script(q.FINALS_LUA,
                             [key for req, _events in part
                              for key in (q.done_key(req.tenant, req.rid),
                                          q.out_key(req.tenant, req.rid))],
                             [self.worker_id, q.OUT_TTL_S,
                              *(x for _req, events in part for x in (len(events), *events))])
        return calls


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
