"""Shared Redis clients (one pool per process and event loop), and Lua scripts in pipelines."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
from django.conf import settings
from redis.exceptions import NoScriptError

from sluice.aio import finish_or_cancel

_hiredis_pack: Any
try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # hiredis is a dependency; without it redis-py packs in Python
    _hiredis_pack = None

_maint_config: Any
try:
    from redis import maint_notifications
    _maint_config = maint_notifications.MaintNotificationsConfig
except ImportError:  # redis-py before 7 has no maintenance notifications
    _maint_config = None

_sync: redis.Redis | None = None


def reconnecting() -> dict[str, Any]:
    """Options for every Redis client of ours, so that a Redis restart costs no call.

    Before reusing a pooled connection, redis-py checks it (closed by the server, or
    unread data left on it) and reconnects if so; redis-py 8 skips that check whenever
    maintenance notifications are on, and they are on ("auto") by default. After a Redis
    restart each idle pooled connection then failed the next command sent on it,
    however much later (the chaos test saw 503s up to 7 s after Redis was back). Sluice
    does not use maintenance notifications (a Redis Enterprise/Cloud feature): off."""
    return {} if _maint_config is None else {
        "maint_notifications_config": _maint_config(enabled=False)}


class PackedConnection(aioredis.Connection):
    """redis-py's asyncio TCP connection, with commands packed by hiredis (C) instead of
    redis-py's Python packer, which was ~8% of the gateway's CPU under load."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if _hiredis_pack is None:
            return super().pack_command(*args)
        first = args[0]
        # Like redis-py: a command name with a space ("SCRIPT LOAD") is several words.
        if (isinstance(first, str) and " " in first) or (
                isinstance(first, bytes) and b" " in first):
            args = (*first.split(), *args[1:])
        return [_hiredis_pack(args)]


def fast_pool_options(url: str) -> dict[str, Any]:
    """Connection-pool options for a hot-path asyncio client of `url`: hiredis packing
    on plain TCP (TLS and unix sockets keep redis-py's own connection classes)."""
    return {"connection_class": PackedConnection} if url.startswith("redis://") else {}


def sync_redis() -> redis.Redis:
    global _sync
    if _sync is None:
        _sync = redis.Redis.from_url(
            settings.REDIS_URL,
            socket_timeout=settings.REDIS_SOCKET_TIMEOUT_S,
            socket_connect_timeout=settings.REDIS_SOCKET_TIMEOUT_S,
            health_check_interval=30,
            **reconnecting(),
        )
    return _sync


def async_redis() -> aioredis.Redis:
    """A new asyncio client; callers keep one per event loop."""
    return aioredis.Redis.from_url(
        settings.REDIS_URL,
        socket_timeout=settings.REDIS_SOCKET_TIMEOUT_S,
        socket_connect_timeout=settings.REDIS_SOCKET_TIMEOUT_S,
        **reconnecting(),
    )


T = TypeVar("T")


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """`items` in runs of at most `size`: what one script call may take, so that no call
    holds Redis (single-threaded) for long."""
    for start in range(0, len(items), size):
        yield items[start:start + size]


class ScriptBatch:
    """A pipeline that runs Lua scripts by EVALSHA without redis-py's per-execute
    `SCRIPT EXISTS` round trip (what `Script(..., client=pipe)` costs every time). A
    script Redis does not know (first use, or after a restart) is run once with EVAL,
    which also caches it; no other command of the batch runs twice.

    Works with a sync or an asyncio client: `run()` or `await run_async()`."""

    def __init__(self, client: redis.Redis | aioredis.Redis) -> None:
        self.client = client
        self.pipe = client.pipeline(transaction=False)
        self._scripts: dict[int, tuple[str, list[Any]]] = {}

    def script(self, source: str, keys: list[str], args: list[Any]) -> None:
        argv = [len(keys), *keys, *args]
        self._scripts[len(self.pipe.command_stack)] = (source, argv)
        self.pipe.evalsha(sha1(source), *argv)

    def _missing(self, replies: list[Any]) -> list[tuple[int, str, list[Any]]]:
        """The scripts Redis did not know, to run once more with EVAL; any other failed
        command raises its error."""
        missing = []
        for i, reply in enumerate(replies):
            if isinstance(reply, NoScriptError) and i in self._scripts:
                missing.append((i, *self._scripts[i]))
            elif isinstance(reply, Exception):
                raise reply
        return missing

    def run(self) -> list[Any]:
        replies = self.pipe.execute(raise_on_error=False)
        for i, source, argv in self._missing(replies):
            replies[i] = self.client.eval(source, *argv)
        return list(replies)

    async def run_async(self) -> list[Any]:
        replies = await self.pipe.execute(raise_on_error=False)
        for i, source, argv in self._missing(replies):
            replies[i] = await self.client.eval(source, *argv)
        return list(replies)


class DirectConnection:
    """One Redis connection for a single task's sequential round trips (the Coalescer's
    batches, the result router's reads), used directly instead of through the client's
    pool: one write of the packed commands, then the replies read in order under one
    deadline. redis-py's per-command path (a pool checkout and release with their locks
    and bookkeeping, a task per write and a timer per reply, reply callbacks) had cost
    more than the commands' own packing and parsing. Replies are Redis's raw ones.

    A connection idle for a while is checked before use (Redis may have restarted
    meanwhile), as the pool checks the ones it hands out. Nothing is sent twice: a round
    trip that fails raises a RedisError (a deadline too: redis.TimeoutError) and drops
    the connection; the next one reconnects."""

    IDLE_CHECK_S = 1.0

    def __init__(self, client: aioredis.Redis, *, timeout_s: float | None = None) -> None:
        pool = client.connection_pool
        self._class = pool.connection_class
        # The round trip's deadline replaces the connection's per-read timeouts.
        self._kwargs = {**pool.connection_kwargs, "socket_timeout": None}
        self.timeout_s = float(timeout_s or pool.connection_kwargs.get("socket_timeout")
                               or 10.0)
        self._conn: aioredis.Connection | None = None
        self._used = 0.0

    async def _connection(self) -> aioredis.Connection:
        conn = self._conn
        if conn is not None and time.monotonic() - self._used > self.IDLE_CHECK_S:
            try:
                if await conn.can_read():  # unread data on an idle connection: unusable
                    raise redis.ConnectionError("unexpected data")
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                await conn.disconnect(nowait=True)
                conn = None
        if conn is None:
            conn = self._conn = self._class(**self._kwargs)
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
        try:
            async with asyncio.timeout(deadline):
                conn = await self._connection()
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
            if dead is not None:
                await dead.disconnect(nowait=True)
            if isinstance(exc, TimeoutError) and not isinstance(exc, redis.RedisError):
                raise redis.TimeoutError(f"Redis did not answer {len(commands)} "
                                         f"command(s) within {deadline:g} s") from None
            raise
        finally:
            self._used = time.monotonic()
        return replies

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.disconnect()


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
    docs/BENCHMARKS.md, "eighth pass"). Calls of one turn that find every connection
    busy leave together when the first one comes back.

    A reply that is an error fails only its own call; a failed round trip fails the
    calls of its batch (each sees the RedisError) and is not sent again. A script Redis
    does not know (first use, or after a restart) is run once more with EVAL, which
    caches it."""

    IN_FLIGHT = 4

    def __init__(self, client: aioredis.Redis, *, in_flight: int = IN_FLIGHT) -> None:
        self.client = client
        self.connections = [DirectConnection(client) for _ in range(max(1, in_flight))]
        self._idle = self.connections[::-1]  # a stack: pop() takes the latest returned
        self._queued: list[tuple[str, list[str], list[Any], asyncio.Future[Any]]] = []
        self._due = False  # a batch leaves at the loop's next turn
        self._batches: set[asyncio.Task[None]] = set()
        self._closed = False

    def script(self, source: str, keys: list[str], args: list[Any]) -> asyncio.Future[Any]:
        """The script's reply, as a future to await."""
        if self._closed:
            raise redis.ConnectionError("the coalescer is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queued.append((source, keys, args, future))
        self._send_soon(loop)
        return future

    def _send_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        # At the next turn: the scripts the calls of this turn add go with this one.
        if not self._due and self._idle:
            self._due = True
            loop.call_soon(self._send)

    def _send(self) -> None:
        self._due = False
        if self._closed:
            self._fail_queued()
            return
        if not self._queued or not self._idle:
            return
        calls, self._queued = self._queued, []
        task = asyncio.get_running_loop().create_task(self._batch(self._idle.pop(), calls))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    async def _batch(self, connection: DirectConnection,
                     calls: list[tuple[str, list[str], list[Any], asyncio.Future[Any]]]
                     ) -> None:
        try:
            replies = await self._run(connection, calls)
        except Exception as exc:  # the connection: every call of the batch fails
            for *_, future in calls:
                if not future.done():
                    future.set_exception(exc)
        except BaseException:  # cancelled (the loop is closing): so are its calls
            for *_, future in calls:
                future.cancel()
            raise
        else:
            for (*_, future), reply in zip(calls, replies, strict=True):
                if future.done():
                    continue  # its caller was cancelled
                if isinstance(reply, Exception):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        finally:
            self._idle.append(connection)
            if self._queued:  # calls that found every connection busy
                self._send_soon(asyncio.get_running_loop())

    async def _run(self, connection: DirectConnection,
                   calls: list[tuple[str, list[str], list[Any], asyncio.Future[Any]]]
                   ) -> list[Any]:
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
        return replies

    def _fail_queued(self) -> None:
        calls, self._queued = self._queued, []
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


@functools.cache
def sha1(source: str) -> str:
    return hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
