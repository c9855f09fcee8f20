"""The gateway side of the queue: submit a request, await its events, cancel, resume.

One router task per gateway process reads that process's event stream
(`sluice:gw:<id>`) with a single blocking XREAD and hands each event to the waiting
request, so thousands of in-flight requests cost one Redis connection, not thousands.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from secrets import token_hex
from typing import Any

import orjson

from inference import queue as q
from inference.jobs import FINAL_EVENTS, Event, Job
from inference.routing import lane
from inference.spec import DeploymentSpec
from sluice import gctuning
from sluice.errors import DeadlineExceeded, RateLimited, Unavailable, Unprocessable
from sluice.redis import async_client
from sluice.redisdirect import Coalescer, DirectConnection

logger = logging.getLogger("sluice.inference")
_GRACE_S = 2.0  # wait this long past the deadline for the worker's own 504
_ROUTER_BLOCK_MS = 500  # how long one router read blocks (bounds close() latency)
_TRIM_EVERY_S = 0.1  # how often the router trims the events it has read
LANES_TTL_S = 1.0  # how stale the heartbeats placement reads may be


class RequestHandle:
    def __init__(self, client: InferenceClient, spec: DeploymentSpec, rid: str, tenant: str,
                 deadline_ms: int, events: asyncio.Queue[Event | None]) -> None:
        self.client, self.spec, self.rid, self.tenant = client, spec, rid, tenant
        self.deadline_ms = deadline_ms
        self._queue = events
        self.next_seq = 0
        self.finished = False
        self.replayed = False  # an idempotent retry fed from the first call's events

    async def events(self) -> AsyncIterator[Event]:
        """Events in order, each once; ends after the final `done` or `error` event."""
        # The deadline arrives as an event of its own: one timer per request, not a
        # timeout context per event.
        expiry = asyncio.get_running_loop().call_later(
            max((self.deadline_ms - q.now_ms()) / 1000 + _GRACE_S, 0.001),
            self._queue.put_nowait, None)  # None: the deadline
        try:
            while not self.finished:
                event = await self._queue.get()
                if event is None:
                    await self.cancel()
                    raise DeadlineExceeded("The request's deadline passed.")
                if event["seq"] < self.next_seq and event["t"] not in FINAL_EVENTS:
                    continue  # a duplicate from a worker that took over
                if event["seq"] > self.next_seq:
                    # A gap: a message to this gateway was lost (Redis failover, a worker
                    # dying mid-write). The request's own stream has every event.
                    for missing in await self.client.events_between(
                            self.tenant, self.rid, self.next_seq, event["seq"]):
                        self.next_seq = missing["seq"] + 1
                        yield missing
                self.next_seq = event["seq"] + 1
                if event["t"] in FINAL_EVENTS:
                    self.finished = True
                yield event
        finally:
            expiry.cancel()
            self.client._forget(self.rid)

    async def cancel(self) -> None:
        if not self.finished:
            await self.client.cancel(self.spec.name, self.rid)


class InferenceClient:
    def __init__(self, redis_url: str, *, gateway_id: str | None = None,
                 max_connections: int = 64) -> None:
        # A bounded pool that makes callers wait for a free connection: a burst of
        # submits must queue here, not fail with "Too many connections" (on a Redis
        # Cluster: at most that many per node).
        self.redis = async_client(redis_url, max_connections=max_connections, hot=True,
                                  socket_timeout=10, socket_connect_timeout=5)
        self.gateway_id = gateway_id or token_hex(8)
        self.key = q.gateway_key(self.gateway_id)
        # Blocking reads (the router's, replays) get their own connections and a longer
        # timeout; the router reads on a direct connection of its own (on a cluster, to
        # the node that serves this gateway's stream).
        self._reader = async_client(redis_url, socket_timeout=30, socket_connect_timeout=5)
        self._routing = DirectConnection(self._reader, key=self.key)
        self._trim_due = 0.0
        self._waiting: dict[str, asyncio.Queue[Event | None]] = {}
        self._router: asyncio.Task[None] | None = None
        # Enqueues (and the governance scripts that run before them) of concurrent
        # requests share pipelines.
        self.scripts = Coalescer(self.redis)
        self._last_id = self._trimmed = "0-0"
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = asyncio.Event()
        # Each deployment's live workers (heartbeats) for placement, read at most every
        # LANES_TTL_S: deployment -> (read at, heartbeats by worker id).
        self._beats: dict[str, tuple[float, dict[str, dict[str, Any]]]] = {}

    async def start(self) -> None:
        if self._router is None:
            # Start reading from "now": events for requests submitted after this.
            self._last_id = self._trimmed = f"{q.now_ms()}-0"
            self._router = asyncio.create_task(self._route(), name="sluice-result-router")

    async def close(self) -> None:
        if self._router is not None:
            # Ask the router to stop between reads: cancelling it in the middle of a
            # Redis command can leave a pooled connection waiting for a reply.
            self._closing.set()
            try:
                await asyncio.wait_for(self._router, _ROUTER_BLOCK_MS / 1000 + 5)
            except TimeoutError:
                self._router.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._router
            self._router = None
        with contextlib.suppress(Exception):
            await self.redis.delete(self.key)
        await self.scripts.aclose()
        await self._routing.aclose()
        await self.redis.aclose()
        await self._reader.aclose()

    async def _route(self) -> None:
        while not self._closing.is_set():
            try:
                await self._route_once()
            except Exception:
                # A Redis blip (a restart, a failover): retry from the same position,
                # nothing is lost. The router must outlive any error: every waiting
                # request of this process depends on it.
                logger.warning("result router: Redis failed; retrying", exc_info=True)
                await asyncio.sleep(0.2)

    async def _route_once(self) -> None:
        [reply] = await self._routing.run([(
            "XREAD", "COUNT", 1000, "BLOCK", _ROUTER_BLOCK_MS, "STREAMS", self.key,
            self._last_id)])
        if isinstance(reply, Exception):
            raise reply
        # Redis's own reply: {key: [[id, [field, value, ...]], ...]} (RESP3, redis-py's
        # default), or [[key, entries]] (RESP2).
        # No collection while a read's events are decoded and routed, nor while the
        # streams they wake send them (at 10,000 streams, one step's wave): the
        # collector runs at the loop's next turn instead (sluice/gctuning.py).
        with gctuning.held(asyncio.get_running_loop()):
            for _key, entries in (reply.items() if isinstance(reply, dict) else reply or []):
                for msg_id, fields in entries:
                    self._last_id = msg_id.decode()
                    for rid, event in orjson.loads(fields[fields.index(b"b") + 1]):
                        waiting = self._waiting.get(rid)
                        if waiting is not None:
                            waiting.put_nowait(event)
        if self._trimmed != self._last_id and time.monotonic() >= self._trim_due:
            # Our own stream: keep it short and let it vanish if this process dies. At
            # most every _TRIM_EVERY_S, not after every read (a read under load brings
            # an event or two, and the trim had cost as much as the read).
            self._trim_due = time.monotonic() + _TRIM_EVERY_S
            for answer in await self._routing.run([
                    # MINID keeps its own id: trim past the last entry read too (it
                    # may hold a reply's last text), also after an idle read.
                    ("XTRIM", self.key, "MINID", _next_id(self._last_id)),
                    ("EXPIRE", self.key, q.OUT_TTL_S)]):
                if isinstance(answer, Exception):
                    raise answer
            self._trimmed = self._last_id

    def _forget(self, rid: str) -> None:
        self._waiting.pop(rid, None)

    async def submit(
        self,
        spec: DeploymentSpec,
        *,
        tenant: str,
        job: Job,
        timeout_s: float = 60.0,
        priority: int = 0,
        traceparent: str = "",
        idempotency_key: str | None = None,
        fingerprint: str = "",
        owner: str | None = None,
        affinity: bytes | None = None,
    ) -> RequestHandle:
        """Enqueue, or raise Unavailable (queue full) / RateLimited (tenant's share full).

        `idempotency_key` (already scoped to its caller: the queue stores it as given) with
        `fingerprint` (a digest of the request): a second submit with the same key and
        fingerprint is fed the first one's events; with another fingerprint it is
        Unprocessable. `owner` (opaque to the queue): stored beside the request for as
        long as its events can be read again (`owner_of`); a request without one cannot
        be resumed. `affinity`: the call's prefix key; the request goes to the lane of
        the worker it picks (inference/routing.py `lane`), where its prefix is likely
        cached."""
        if self._router is None:
            await self.start()
        rid = token_hex(12)
        deadline_ms = q.now_ms() + int(timeout_s * 1000)
        if idempotency_key is not None:
            key = q.idem_key(tenant, idempotency_key)
            record = orjson.dumps({"rid": rid, "fp": fingerprint})
            # Twice: the first request's key may be freed (it was abandoned) between the
            # SET that found it and the GET.
            raw: bytes | None = None
            for _attempt in range(2):
                if await self.redis.set(key, record, nx=True, ex=q.IDEM_TTL_S):
                    raw = None
                    break
                raw = await self.redis.get(key)
                if raw is not None:
                    break
            else:
                raise Unavailable("The request queue is busy; try again shortly.",
                                  code="queue_unavailable", headers={"Retry-After": "1"})
            if raw is not None:
                existing = _idem_record(raw)
                if existing is None or existing.get("fp") != fingerprint:
                    raise Unprocessable(
                        "This Idempotency-Key was already used with a different request; "
                        "use a new key for a new request.", code="idempotency_key_reused",
                        param="Idempotency-Key")
                return self._replaying(spec, str(existing["rid"]), tenant, deadline_ms)
        if owner is not None:
            await self.redis.set(q.owner_key(tenant, rid), owner,
                                 ex=int(timeout_s) + q.OUT_TTL_S)
        events: asyncio.Queue[Event | None] = asyncio.Queue()
        self._waiting[rid] = events
        request = q.QueuedRequest.of(job, rid=rid, tenant=tenant,
                                     gateway=self.gateway_id, deadline_ms=deadline_ms,
                                     priority=max(0, min(q.MAX_PRIORITY, priority)),
                                     traceparent=traceparent)
        flat = [x for kv in request.fields().items() for x in kv]
        cap = q.tenant_cap(spec.max_queue_depth, spec.tenant_queue_share)
        suffix = q.stream_suffix(tenant, request.priority,
                                 await self._lane(spec.name, affinity) if affinity else "")
        try:
            status, _detail = await self.scripts.script(
                q.ENQUEUE_LUA, q.queue_keys(spec.name, suffix),
                [spec.max_queue_depth, cap, tenant, suffix, *flat])
        except BaseException:
            # The caller left (a client disconnect cancels its task) or Redis failed
            # with the enqueue sent: it may be queued with no one waiting for it.
            # Cancel it, or a worker runs the whole generation for nobody.
            self._forget(rid)
            self._in_background(self._abandon(spec.name, tenant, rid, idempotency_key))
            raise
        if status != 1:
            self._forget(rid)
            if idempotency_key is not None:
                await self.redis.delete(q.idem_key(tenant, idempotency_key))
            if status == -1:
                raise Unavailable(f"Model '{spec.name}' is overloaded: its queue is full.",
                                  headers={"Retry-After": "1"})
            raise RateLimited(f"Too many requests queued for model '{spec.name}' by your "
                              f"tenant (limit {cap}).", retry_after_s=1,
                              code="tenant_queue_full")
        return RequestHandle(self, spec, rid, tenant, deadline_ms, events)

    async def _abandon(self, deployment: str, tenant: str, rid: str,
                       idempotency_key: str | None) -> None:
        """Cancel a request its caller no longer waits for; a retry with the same
        idempotency key then runs afresh rather than replaying the cancellation."""
        await self.cancel(deployment, rid)
        if idempotency_key is not None:
            await self.redis.delete(q.idem_key(tenant, idempotency_key))

    def _replaying(self, spec: DeploymentSpec, rid: str, tenant: str,
                   deadline_ms: int) -> RequestHandle:
        """A handle fed from the request's own stream (idempotent retry, resume)."""
        events: asyncio.Queue[Event | None] = asyncio.Queue()
        handle = RequestHandle(self, spec, rid, tenant, deadline_ms, events)
        handle.replayed = True

        async def pump() -> None:
            with contextlib.suppress(DeadlineExceeded):  # the handle raises its own
                async for event in self.replay(tenant, rid, after_seq=-1,
                                               timeout_s=(deadline_ms - q.now_ms()) / 1000):
                    events.put_nowait(event)

        self._in_background(pump())
        return handle

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in a task of its own (kept until it ends; a failure is logged)."""
        async def run() -> None:
            try:
                await work
            except Exception:
                logger.warning("background queue operation failed", exc_info=True)

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def owner_of(self, tenant: str, rid: str) -> str | None:
        """What `submit` stored as the request's owner; None once its events expired (or
        for a request submitted without one)."""
        raw = await self.redis.get(q.owner_key(tenant, rid))
        return raw.decode() if raw else None

    async def attach(self, tenant: str, rid: str) -> bool:
        """Mark a stream as resumed by a client; False if no such request exists."""
        if not await self.redis.exists(q.out_key(tenant, rid)):
            return False
        await self.redis.set(q.attached_key(tenant, rid), "1", ex=q.OUT_TTL_S)
        return True

    async def remember_stream(self, tenant: str, conversation: str, rid: str) -> None:
        await self.redis.set(q.conversation_stream_key(tenant, conversation), rid,
                             ex=q.OUT_TTL_S)

    async def latest_stream(self, tenant: str, conversation: str) -> str | None:
        rid = await self.redis.get(q.conversation_stream_key(tenant, conversation))
        return rid.decode() if rid else None

    async def cancel_unless_resumed(self, deployment: str, tenant: str, rid: str,
                                    grace_s: float) -> None:
        """Cancel after `grace_s` unless a client re-attached meanwhile (any gateway)."""
        await asyncio.sleep(grace_s)
        if not await self.redis.exists(q.attached_key(tenant, rid)):
            await self.cancel(deployment, rid)

    async def cancel(self, deployment: str, rid: str) -> None:
        key = q.cancel_key(deployment)
        pipe = self.redis.pipeline(transaction=False)
        pipe.sadd(key, rid)
        pipe.expire(key, 3600)
        await pipe.execute()

    async def replay(self, tenant: str, rid: str, *, after_seq: int = -1,
                     timeout_s: float = 60.0) -> AsyncIterator[Event]:
        """A request's events after `after_seq`, live until its final event (resume)."""
        key = q.out_key(tenant, rid)
        deadline = time.monotonic() + timeout_s
        last = "0-0"
        while time.monotonic() < deadline:
            block = max(1, int(min(5.0, deadline - time.monotonic()) * 1000))
            reply = await self._reader.xread({key: last}, block=block, count=1000)
            for _key, entries in reply or []:
                for msg_id, fields in entries:
                    last = msg_id.decode()
                    event = json.loads(fields[b"e"])
                    if event["seq"] > after_seq or event["t"] in FINAL_EVENTS:
                        yield event
                    if event["t"] in FINAL_EVENTS:
                        return
        raise DeadlineExceeded("The request's deadline passed.")

    async def events_between(self, tenant: str, rid: str, first: int,
                             end: int) -> list[Event]:
        """Non-final events with first <= seq < end, from the request's own stream."""
        out = []
        for _id, fields in await self.redis.xrange(q.out_key(tenant, rid)):
            event = json.loads(fields[b"e"])
            if first <= event["seq"] < end and event["t"] not in FINAL_EVENTS:
                out.append(event)
        return out

    async def _lane(self, deployment: str, affinity: bytes) -> str:
        """The lane for a call with prefix key `affinity` ("" for the shared stream),
        from heartbeats at most LANES_TTL_S old."""
        now = time.monotonic()
        read_at, beats = self._beats.get(deployment, (0.0, {}))
        if now - read_at > LANES_TTL_S:
            beats = await self.workers(deployment)
            self._beats[deployment] = (now, beats)
        return lane(affinity, beats)

    async def workers(self, deployment: str, *, max_age_s: float = q.HEARTBEAT_MAX_AGE_S
                      ) -> dict[str, dict[str, Any]]:
        """Live workers of a deployment: heartbeat JSON by worker id."""
        raw = await self.redis.hgetall(q.workers_key(deployment))
        return q.live_heartbeats(raw, max_age_s=max_age_s)

    async def queue_stats(self, deployment: str) -> dict[str, int]:
        """Queued-or-running count and the age of the oldest entry, in ms."""
        suffixes = [s.decode() for s in await self.redis.hkeys(q.streams_key(deployment))]
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(q.depth_key(deployment))
        for suffix in suffixes:
            pipe.xrange(q.stream_key(deployment, suffix), count=1)
        depth, *firsts = await pipe.execute()
        return {"depth": int(depth or 0), "oldest_age_ms": q.oldest_age_ms(firsts)}


def _next_id(stream_id: str) -> str:
    """The smallest stream id after `stream_id` ("ms-seq")."""
    ms, _, seq = stream_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def _idem_record(raw: bytes | None) -> dict[str, Any] | None:
    """An idempotency record ({"rid", "fp"}), None if absent or not one."""
    try:
        record = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("rid"), str) else None
