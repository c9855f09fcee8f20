"""The hot path's own Redis round trips, outside redis-py's per-command path:
DirectConnection (one connection; commands written at once, replies read in order under
one deadline) and the Coalescer (the scripts of concurrent calls in one write).

Both work against a single Redis and against a Redis Cluster. On a cluster a connection
goes to the node that owns a slot, as redis-py's cluster client's slot map says; what the
node did not run (a MOVED or ASK reply, TRYAGAIN, CLUSTERDOWN, or a connection that could
not be made) is left to redis-py's cluster client, which follows the redirection or
refreshes its topology (a failover) and so moves the next round trips to the new owner.
Nothing that may have run is sent twice.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    RedisClusterException,
    TryAgainError,
)

from sluice.aio import finish_or_cancel
from sluice.redis import AsyncClient, PackedConnection, is_cluster, sha1

# Replies that say the node did not run the command: safe to send it again elsewhere.
# (MovedError is an AskError.)
NOT_RUN = (AskError, TryAgainError, ClusterDownError)


def _unblocked(reply: Any) -> bool:
    """A blocking read that a node ended because it stopped being a master (a failover):
    Redis answers UNBLOCKED and closes the connection."""
    return isinstance(reply, redis.ResponseError) and str(reply).startswith("UNBLOCKED")


class NotSent(redis.ConnectionError):
    """A round trip that failed before any of its commands left: the connection could
    not be made, so Redis ran none of them."""


class DirectConnection:
    """One Redis connection for a single task's sequential round trips (the Coalescer's
    batches, the result router's reads), used directly instead of through the client's
    pool: one write of the packed commands, then the replies read in order under one
    deadline. redis-py's per-command path (a pool checkout and release with their locks
    and bookkeeping, a task per write and a timer per reply, reply callbacks) had cost
    more than the commands' own packing and parsing. Replies are Redis's raw ones.

    On a cluster client, the connection goes to the node that serves `key`'s slot
    (`key` is required unless `node`, a redis-py ClusterNode, names the server). After a
    round trip that failed or that a node refused (a redirection: the slot moved), the
    next one first asks the cluster client where the slot is now (a read of `key`
    through it, which follows MOVED and refreshes the topology within its retries).

    A connection idle for a while is checked before use (Redis may have restarted
    meanwhile), as the pool checks the ones it hands out. Nothing is sent twice: a round
    trip that fails raises a RedisError (a deadline too: redis.TimeoutError; a
    connection that could not be made: NotSent) and drops the connection; the next one
    reconnects."""

    IDLE_CHECK_S = 1.0

    def __init__(self, client: AsyncClient, *, key: str | None = None, node: Any = None,
                 timeout_s: float | None = None) -> None:
        self._client = client
        self._cluster = is_cluster(client)
        if self._cluster and key is None and node is None:
            raise ValueError("a DirectConnection to a cluster needs a key or a node")
        self._key, self._node = key, node
        kwargs = (client.get_connection_kwargs() if self._cluster
                  else client.connection_pool.connection_kwargs)
        self.timeout_s = float(timeout_s or kwargs.get("socket_timeout") or 10.0)
        self._conn: aioredis.Connection | None = None
        self._used = 0.0
        self._relocate = False  # cluster: ask where the key's slot is before the next trip

    def _target(self) -> tuple[type[aioredis.Connection], dict[str, Any]]:
        if not self._cluster:
            pool = self._client.connection_pool
            return pool.connection_class, pool.connection_kwargs
        node = self._node or self._client.get_node_from_key(self._key)
        cls = node.connection_class
        # No retries of its own: the round trip fails once, and the cluster client retries.
        return ((PackedConnection if cls is aioredis.Connection else cls),
                {**node.connection_kwargs, "retry": Retry(NoBackoff(), 0)})

    async def _connection(self) -> aioredis.Connection:
        if self._cluster and self._node is None:
            if self._relocate:
                await self._client.exists(self._key)  # redis-py finds the slot's owner
                self._relocate = False
            await self._client.initialize()  # the slot map, once (no-op afterwards)
        cls, kwargs = self._target()
        conn = self._conn
        if self._cluster and conn is not None and (conn.host, conn.port) != (
                kwargs["host"], kwargs["port"]):
            await conn.disconnect(nowait=True)  # the slot moved to another node
            conn = self._conn = None
        if conn is not None and time.monotonic() - self._used > self.IDLE_CHECK_S:
            try:
                if await conn.can_read():  # unread data on an idle connection: unusable
                    raise redis.ConnectionError("unexpected data")
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                await conn.disconnect(nowait=True)
                conn = None
        if conn is None:
            # The round trip's deadline replaces the connection's per-read timeouts.
            conn = self._conn = cls(**{**kwargs, "socket_timeout": None})
        if not conn.is_connected:
            await conn.connect()
        return conn

    async def run(self, commands: Sequence[Sequence[Any]], *,
                  timeout_s: float | None = None) -> list[Any]:
        """The replies to `commands`, in order; a reply that is an error is returned as
        its exception (redis.ResponseError). `timeout_s`: this round trip's deadline
        (connecting included), when not the default."""
        deadline = self.timeout_s if timeout_s is None else timeout_s
        replies: list[Any] = []
        sending = False
        try:
            async with asyncio.timeout(deadline):
                conn = await self._connection()
                sending = True
                await conn.send_packed_command(conn.pack_commands(commands),
                                               check_health=False)
                for _ in commands:
                    try:
                        replies.append(await conn.read_response(timeout=math.inf))
                    except redis.ResponseError as exc:
                        replies.append(exc)
        except BaseException as exc:
            # A reply half read, or one never read: the connection cannot be reused.
            dead, self._conn = self._conn, None
            self._relocate = True
            if dead is not None:
                await dead.disconnect(nowait=True)
            if not sending and isinstance(exc, OSError | redis.ConnectionError | TimeoutError
                                          ) and not isinstance(exc, NotSent):
                raise NotSent(f"Redis could not be reached: {type(exc).__name__}: "
                              f"{exc}") from exc
            if isinstance(exc, TimeoutError) and not isinstance(exc, redis.RedisError):
                raise redis.TimeoutError(f"Redis did not answer {len(commands)} "
                                         f"command(s) within {deadline:g} s") from None
            if isinstance(exc, RedisClusterException):  # the slot's owner is unknown
                raise NotSent(str(exc)) from exc
            raise
        finally:
            self._used = time.monotonic()
        if self._cluster and any(isinstance(r, NOT_RUN) or _unblocked(r) for r in replies):
            self._relocate = True
            if any(_unblocked(r) for r in replies):  # the node closes it after the reply
                dead, self._conn = self._conn, None
                if dead is not None:
                    await dead.disconnect(nowait=True)
        return replies

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.disconnect()


_Call = tuple[str, list[str], list[Any], "asyncio.Future[Any]"]


class _Lane:
    """One Redis server's connections of a Coalescer, and the calls waiting for one."""

    __slots__ = ("connections", "due", "idle", "queued")

    def __init__(self, connections: list[DirectConnection]) -> None:
        self.connections = connections
        self.idle = connections[::-1]  # a stack: pop() takes the latest returned
        self.queued: list[_Call] = []
        self.due = False  # a batch leaves at the loop's next turn


class Coalescer:
    """Scripts that many concurrent calls run go to Redis together: each call awaits
    its own reply, and what the calls of one event-loop turn ask for leaves as one
    write. Under load, dozens of calls share a round trip; idle, a call waits for
    nothing but its own round trip. One per asyncio client (and so per event loop).

    Up to `in_flight` batches are out at once, each on a DirectConnection of the
    coalescer's own (the most recently used first, so a lightly loaded coalescer keeps
    to one). With one batch at a time, every call that arrived meanwhile waited for the
    batch's reply and then for the next batch's whole round trip, and at 64 concurrent
    calls that wait was most of a call's latency while the gateway sat idle (see
    docs/BENCHMARKS.md, "CPU per call, by process"). Calls of one turn that find every connection
    busy leave together when the first one comes back. On a cluster, each node has its
    own connections and batches (a script goes to the node of its first key's slot).

    A reply that is an error fails only its own call; a failed round trip fails the
    calls of its batch (each sees the RedisError) and is not sent again. A script Redis
    does not know (first use, or after a restart) is run once more with EVAL, which
    caches it. On a cluster, a script its node did not run (a redirection after a
    failover; a node that could not be reached) is sent through the cluster client,
    which finds the slot's owner within its retries."""

    IN_FLIGHT = 4

    def __init__(self, client: AsyncClient, *, in_flight: int = IN_FLIGHT) -> None:
        self.client = client
        self._cluster = is_cluster(client)
        self._in_flight = max(1, in_flight)
        self._lanes: dict[str, _Lane] = {}
        if not self._cluster:
            self._lanes[""] = _Lane([DirectConnection(client) for _ in range(self._in_flight)])
        self._unrouted: list[_Call] = []  # cluster: waiting for the slot map
        self._batches: set[asyncio.Task[Any]] = set()
        self._closed = False

    @property
    def connections(self) -> list[DirectConnection]:
        return [c for lane in self._lanes.values() for c in lane.connections]

    @property
    def _queued(self) -> list[_Call]:
        """Calls not sent yet."""
        return [*self._unrouted, *(c for lane in self._lanes.values() for c in lane.queued)]

    def script(self, source: str, keys: list[str], args: list[Any]) -> asyncio.Future[Any]:
        """The script's reply, as a future to await."""
        if self._closed:
            raise redis.ConnectionError("the coalescer is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        call = (source, keys, args, future)
        lane = self._lanes[""] if not self._cluster else self._lane_of(keys)
        if lane is None:
            self._unrouted.append(call)
            if len(self._unrouted) == 1:
                self._spawn(self._route_unrouted())
        else:
            lane.queued.append(call)
            self._send_soon(lane, loop)
        return future

    def _lane_of(self, keys: list[str]) -> _Lane | None:
        """The lane of the node serving the keys' slot; None while the slot map is not
        known (the client's first command reads it)."""
        if not self.client.nodes_manager.slots_cache:
            return None
        try:
            node = self.client.get_node_from_key(keys[0]) if keys else None
        except RedisClusterException:
            node = None
        if node is None:
            return None
        lane = self._lanes.get(node.name)
        if lane is None:
            lane = self._lanes[node.name] = _Lane(
                [DirectConnection(self.client, node=node) for _ in range(self._in_flight)])
        return lane

    async def _route_unrouted(self) -> None:
        """Read the slot map, then send the calls that waited for it (through the
        cluster client those whose slot has no node)."""
        try:
            await self.client.initialize()
        except Exception as exc:
            calls, self._unrouted = self._unrouted, []
            for *_, future in calls:
                if not future.done():
                    future.set_exception(exc)
            return
        calls, self._unrouted = self._unrouted, []
        loop = asyncio.get_running_loop()
        strays = []
        for call in calls:
            lane = self._lane_of(call[1])
            if lane is None:
                strays.append(call)
            else:
                lane.queued.append(call)
                self._send_soon(lane, loop)
        for call, reply in zip(strays, await self._through_client(strays), strict=True):
            _settle(call[3], reply)

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    def _send_soon(self, lane: _Lane, loop: asyncio.AbstractEventLoop) -> None:
        # At the next turn: the scripts the calls of this turn add go with this one.
        if not lane.due and lane.idle:
            lane.due = True
            loop.call_soon(self._send, lane)

    def _send(self, lane: _Lane) -> None:
        lane.due = False
        if self._closed:
            self._fail_queued()
            return
        if not lane.queued or not lane.idle:
            return
        calls, lane.queued = lane.queued, []
        self._spawn(self._batch(lane, lane.idle.pop(), calls))

    async def _batch(self, lane: _Lane, connection: DirectConnection,
                     calls: list[_Call]) -> None:
        try:
            try:
                replies = await self._run(connection, calls)
            except NotSent:
                if not self._cluster:
                    raise
                # None of them ran: the cluster client sends each where its slot is
                # served now (the node is down and a replica is being promoted).
                replies = await self._through_client(calls)
        except Exception as exc:  # the connection: every call of the batch fails
            for *_, future in calls:
                if not future.done():
                    future.set_exception(exc)
        except BaseException:  # cancelled (the loop is closing): so are its calls
            for *_, future in calls:
                future.cancel()
            raise
        else:
            for call, reply in zip(calls, replies, strict=True):
                _settle(call[3], reply)
        finally:
            lane.idle.append(connection)
            if lane.queued:  # calls that found every connection busy
                self._send_soon(lane, asyncio.get_running_loop())

    async def _run(self, connection: DirectConnection, calls: list[_Call]) -> list[Any]:
        replies = await connection.run(
            [("EVALSHA", sha1(source), len(keys), *keys, *args)
             for source, keys, args, _ in calls])
        for i, reply in enumerate(replies):
            if isinstance(reply, NoScriptError):
                source, keys, args, _ = calls[i]
                try:
                    replies[i] = await self.client.eval(source, len(keys), *keys, *args)
                except redis.ResponseError as exc:
                    replies[i] = exc
            elif self._cluster and isinstance(reply, NOT_RUN):
                [replies[i]] = await self._through_client([calls[i]])
        return replies

    async def _through_client(self, calls: list[_Call]) -> list[Any]:
        """Each call's reply (or error) from the cluster client, which routes it."""
        async def one(source: str, keys: list[str], args: list[Any]) -> Any:
            try:
                try:
                    return await self.client.evalsha(sha1(source), len(keys), *keys, *args)
                except NoScriptError:
                    return await self.client.eval(source, len(keys), *keys, *args)
            except redis.RedisError as exc:
                return exc

        return list(await asyncio.gather(*(one(s, k, a) for s, k, a, _ in calls)))

    def _fail_queued(self) -> None:
        calls = self._queued
        self._unrouted = []
        for lane in self._lanes.values():
            lane.queued = []
        for *_, future in calls:
            if not future.done():
                future.set_exception(redis.ConnectionError("the coalescer is closed"))

    async def aclose(self, *, grace_s: float = 2.0) -> None:
        """Stop taking scripts; let the batches in flight finish (up to `grace_s`, then
        cancel them: their calls are cancelled), fail the calls still queued (a
        ConnectionError, retriable), and close the connections (its client's pool is
        the caller's)."""
        self._closed = True
        await finish_or_cancel(self._batches, grace_s)
        self._fail_queued()
        for connection in self.connections:
            await connection.aclose()


def _settle(future: asyncio.Future[Any], reply: Any) -> None:
    if future.done():
        return  # its caller was cancelled
    if isinstance(reply, Exception):
        future.set_exception(reply)
    else:
        future.set_result(reply)
