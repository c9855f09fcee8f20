"""Redis clients for every part of Sluice, on a single Redis or a Redis Cluster, and Lua
scripts in pipelines.

One URL says which: `redis://` / `rediss://` is one server (redis-py's URL), and
`redis+cluster://[user:password@]host:port,host:port,.../` (`rediss+cluster://` with TLS)
names seed nodes of a Redis Cluster, whose topology redis-py's cluster clients discover
and follow (MOVED, failovers). `sync_client` / `async_client` build either from a URL;
`sync_redis` / `async_redis` from settings.REDIS_URL. Every key Sluice writes carries a
`{tenant}` or `{deployment}` hash tag, and every script's keys share one tag, so each
script runs on one node; pipelines are non-transactional (on a cluster, redis-py's
cluster pipeline sends each command to its slot's node).

A cluster that cannot be reached at all fails as `ClusterUnavailable`, a
redis.ConnectionError, as a single Redis that cannot be reached does (redis-py raises
RedisClusterException there, which is not a RedisError): every caller's handling of
Redis failing (a retriable 503, a loop that waits and retries) applies unchanged.
DirectConnection and Coalescer (the hot path's own round trips) are in sluice.redisdirect.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster as synccluster
from django.conf import settings
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import EqualJitterBackoff
from redis.exceptions import (
    MaxConnectionsError,
    NoScriptError,
    RedisClusterException,
    RedisClusterUnreachableError,
    SlotNotCoveredError,
)
from redis.retry import Retry

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

# redis.Redis | redis.cluster.RedisCluster, and their asyncio twins (mypy skips redis-py's
# own types: its replies are Any to us).
SyncClient: TypeAlias = Any
AsyncClient: TypeAlias = Any

_sync: SyncClient | None = None


# -- URLs ----------------------------------------------------------------------------
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


@dataclass(frozen=True)
class ClusterSeeds:
    """A cluster URL taken apart: its seed nodes, and the same URL as redis-py's single
    server URL of the first seed (credentials, TLS and query options, for parse_url)."""

    nodes: tuple[tuple[str, int], ...]
    node_url: str


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() in _CLUSTER_SCHEMES


def cluster_seeds(url: str) -> ClusterSeeds:
    """The seeds of a `redis+cluster://` URL; ValueError naming what is wrong (never the
    password) when it is not one: no node, a port outside 1..65535, a database other
    than 0 (a cluster has only 0)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _CLUSTER_SCHEMES:
        raise ValueError("a cluster URL starts with redis+cluster:// or rediss+cluster://")
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    userinfo, at, hosts = netloc.rpartition("@")
    path, _, query = tail.partition("?")
    if path.strip("/") not in ("", "0"):
        raise ValueError("a Redis Cluster has only database 0: the URL's path must be / or /0")
    nodes = []
    for item in hosts.split(","):
        item = item.strip()
        if not item:
            continue
        if item.startswith("["):  # [IPv6]:port
            host, _, port_text = item[1:].partition("]")
            port_text = port_text.removeprefix(":")
        else:
            host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
        try:
            port = int(port_text or 6379)
        except ValueError:
            raise ValueError(f"cluster node {item!r}: the port is not a number") from None
        if not host or not 1 <= port <= 65535:
            raise ValueError(f"cluster node {item!r}: expected host:port, port 1..65535")
        nodes.append((host, port))
    if not nodes:
        raise ValueError("a cluster URL names at least one node (host:port)")
    first_host, first_port = nodes[0]
    shown = f"[{first_host}]" if ":" in first_host else first_host
    node_url = (f"{_CLUSTER_SCHEMES[scheme.lower()]}://{userinfo + at}{shown}:{first_port}/0"
                + (f"?{query}" if query else ""))
    return ClusterSeeds(tuple(nodes), node_url)


# -- connections ---------------------------------------------------------------------
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


# -- cluster clients -----------------------------------------------------------------
class ClusterUnavailable(redis.ConnectionError):
    """No node of the cluster could be reached, or a slot has no node serving it."""


def _unavailable(exc: RedisClusterException) -> ClusterUnavailable | None:
    """The retriable error a cluster-wide outage is raised as; None for the errors that
    are a program's or a configuration's (cross-slot keys, cluster mode off), which keep
    their type."""
    if isinstance(exc, RedisClusterUnreachableError | SlotNotCoveredError) or \
            str(exc).startswith("All slots are not covered"):
        return ClusterUnavailable(str(exc))
    return None


def _retry_policy(retry_class: type[Retry] | type[AsyncRetry]) -> Any:
    """Retries of a cluster command (a connection error, a timeout, CLUSTERDOWN): what a
    master failover costs. EqualJitterBackoff's shortest waits (half of each step,
    0.025 s doubling to 0.25 s) add up to settings.REDIS_CLUSTER_RETRY_S, so a command
    keeps trying for at least that long, each attempt after a topology refresh that
    finds a promoted replica; an attempt on a node that does not answer (rather than
    refusing) also waits its connect timeout. MOVED and ASK are followed apart from
    these retries."""
    budget, waited, retries = settings.REDIS_CLUSTER_RETRY_S, 0.0, 0
    while waited < budget:
        waited += min(0.5, 0.05 * 2 ** retries) / 2
        retries += 1
    return retry_class(EqualJitterBackoff(cap=0.5, base=0.05), retries)


def _cluster_kwargs(url: str, options: dict[str, Any]) -> tuple[list[tuple[str, int]],
                                                                 dict[str, Any]]:
    seeds = cluster_seeds(url)
    kwargs = {k: v for k, v in redis.connection.parse_url(seeds.node_url).items()
              if k not in ("host", "port", "db")}
    if kwargs.pop("connection_class", None) is redis.connection.SSLConnection:
        kwargs["ssl"] = True
    return list(seeds.nodes), {**kwargs, **reconnecting(), **options}


class _SyncClusterPipeline(synccluster.ClusterPipeline):
    @property
    def command_stack(self) -> list[Any]:
        """The queued commands, as a single Redis's pipeline lists them (redis-py's
        cluster pipeline keeps an empty list under this name)."""
        return list(self._execution_strategy.command_queue)

    def eval(self, *args: Any) -> Any:  # redis-py's sync cluster pipeline refuses EVAL
        """Queue an EVAL, as a single Redis's pipeline does (routed by its keys)."""
        return self.execute_command("EVAL", *args)

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute(*args, **kwargs)
        except RedisClusterException as exc:
            raise _unavailable(exc) or exc from exc


class SyncCluster(synccluster.RedisCluster):
    """redis-py's cluster client; a cluster that cannot be reached raises
    ClusterUnavailable."""

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_command(*args, **kwargs)
        except RedisClusterException as exc:
            raise _unavailable(exc) or exc from exc

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        # The same object with execute() mapping errors as the client's commands do
        # (redis-py builds it from the client's internals; a subclass adds no state).
        pipe.__class__ = _SyncClusterPipeline
        return pipe


class _AsyncClusterPipeline(aiocluster.ClusterPipeline):
    @property
    def command_stack(self) -> list[Any]:
        """The queued commands, as a single Redis's pipeline lists them."""
        return list(self._execution_strategy._command_queue)

    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute(*args, **kwargs)
        except RedisClusterException as exc:
            raise _unavailable(exc) or exc from exc


class AsyncCluster(aiocluster.RedisCluster):
    """redis-py's asyncio cluster client; a cluster that cannot be reached raises
    ClusterUnavailable."""

    async def initialize(self, *args: Any, **kwargs: Any) -> AsyncCluster:
        try:
            await super().initialize(*args, **kwargs)
        except RedisClusterException as exc:
            raise _unavailable(exc) or exc from exc
        return self

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        until = None
        while True:
            try:
                return await super().execute_command(*args, **kwargs)
            except MaxConnectionsError:
                # Every connection to the node is in use (max_connections is per node):
                # wait for one to come back, up to the socket timeout, as a single
                # Redis's blocking pool makes a caller wait. Nothing was sent.
                now = asyncio.get_running_loop().time()
                until = until or now + (self.connection_kwargs.get("socket_timeout") or 10.0)
                if now >= until:
                    raise
                await asyncio.sleep(0.002)
            except RedisClusterException as exc:
                raise _unavailable(exc) or exc from exc

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        return _AsyncClusterPipeline(self, transaction)


def is_cluster(client: Any) -> bool:
    return isinstance(client, synccluster.RedisCluster | aiocluster.RedisCluster)


# -- factories -----------------------------------------------------------------------
def sync_client(url: str, **options: Any) -> SyncClient:
    """A blocking client of `url`, single Redis or cluster. `options`: redis-py's
    (socket_timeout, socket_connect_timeout, health_check_interval, ...); on a cluster
    they apply to each node's connections, and max_connections is per node. A cluster
    is contacted at once (redis-py's sync cluster client reads the topology when
    built): ClusterUnavailable when no seed answers."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **reconnecting(), **options)
    nodes, kwargs = _cluster_kwargs(url, options)
    try:
        return SyncCluster(startup_nodes=[synccluster.ClusterNode(h, p) for h, p in nodes],
                           retry=_retry_policy(Retry), **kwargs)
    except RedisClusterException as exc:
        raise _unavailable(exc) or exc from exc


def async_client(url: str, *, max_connections: int | None = None, hot: bool = False,
                 **options: Any) -> AsyncClient:
    """An asyncio client of `url` (one per event loop), single Redis or cluster; nothing
    is contacted before the first command. `max_connections`: a bound (per node on a
    cluster) whose callers wait for a free connection, up to socket_timeout (a cluster
    pipeline that finds none free fails with a ConnectionError). `hot`: commands packed
    by hiredis (the gateway's hot path)."""
    if not is_cluster_url(url):
        fast = fast_pool_options(url) if hot else {}
        if max_connections is None:
            return aioredis.Redis.from_url(url, **fast, **reconnecting(), **options)
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=options.get("socket_timeout"),
            **fast, **reconnecting(), **options)
        return aioredis.Redis(connection_pool=pool)
    nodes, kwargs = _cluster_kwargs(url, options)
    if max_connections is not None:
        kwargs["max_connections"] = max_connections
    return AsyncCluster(startup_nodes=[aiocluster.ClusterNode(h, p) for h, p in nodes],
                        retry=_retry_policy(AsyncRetry), **kwargs)


def sync_redis() -> SyncClient:
    """The process's blocking client of settings.REDIS_URL (thread-safe)."""
    global _sync
    if _sync is None:
        _sync = sync_client(settings.REDIS_URL, socket_timeout=settings.REDIS_SOCKET_TIMEOUT_S,
                            socket_connect_timeout=settings.REDIS_SOCKET_TIMEOUT_S,
                            health_check_interval=30)
    return _sync


def async_redis() -> AsyncClient:
    """A new asyncio client of settings.REDIS_URL; callers keep one per event loop."""
    return async_client(settings.REDIS_URL, socket_timeout=settings.REDIS_SOCKET_TIMEOUT_S,
                        socket_connect_timeout=settings.REDIS_SOCKET_TIMEOUT_S)


# -- scripts -------------------------------------------------------------------------
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

    Works with a sync or an asyncio client, single Redis or cluster (where each script
    goes to the node of its keys' slot: they must share one): `run()` or
    `await run_async()`."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.pipe = client.pipeline(transaction=False)
        self._scripts: dict[int, tuple[str, list[Any]]] = {}

    def __len__(self) -> int:
        """Commands queued (scripts and the pipe's own)."""
        return len(self.pipe)

    def script(self, source: str, keys: list[str], args: list[Any]) -> None:
        argv = [len(keys), *keys, *args]
        self._scripts[len(self.pipe)] = (source, argv)
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


@functools.cache
def sha1(source: str) -> str:
    return hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
