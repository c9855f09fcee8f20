"""Stored responses written together: the group commit of streaming/responses_store.py.

    await save(row)     # returns once the row is committed (or raises)

One writer thread per process takes every row saved while it was busy and writes them
with one multi-row INSERT (a constant statement per row count, no model instances) on
its own connection: under load N calls share a round trip and a hop between threads;
idle, a save waits for nothing but its own. A thread of its own rather than a database
thread per save (sluice.db.async_db): each hop to a thread and back, and async_db's
connection health check (a SELECT 1 each time), cost the gateway more CPU than the
INSERT itself (docs/BENCHMARKS.md, "Each API's gateway CPU per call (issue #30)").

The contract a caller relies on:
- a save returns after its row is committed (autocommit: the INSERT is its own
  transaction), so every process reads the row as soon as the caller has returned;
- a row whose id is already stored is not written again (ON CONFLICT DO NOTHING: an
  idempotent retry of the same call stores nothing new);
- a DELETE that races a save wins (see `forget`): after its INSERT, a batch looks up
  among the deletions the ids that were given out before their save (a stream's, from
  its first event; a call's that an idempotent retry saves again) and deletes the rows
  a deletion names, before any of its callers returns (an id nobody has seen cannot be
  named: looking it up cost a quarter of a stored call's gateway CPU);
- a database outage fails every save of its batch with the retriable 503
  (`database_unavailable`), after one more try on a new connection (a connection the
  server cut while idle costs no call); Redis failing, with the queue's 503; any other
  error of a batch (one bad row) is retried row by row, so that it fails its own save
  only.
The thread closes its connection after IDLE_CLOSE_S without work, and reopens one past
the database's CONN_MAX_AGE, as a request's connection would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import queue
import threading
import time
from collections import defaultdict
from datetime import datetime
from typing import Any, NamedTuple, cast

import orjson
from django.conf import settings
from django.db import connection
from django.db.models import Field, JSONField
from django.db.models.constants import OnConflict
from redis.exceptions import RedisError

from sluice.db import OUTAGE
from sluice.errors import database_unavailable
from sluice.redis import sync_redis
from streaming.gateway import queue_unavailable
from streaming.models import StoredResponse

logger = logging.getLogger(__name__)
MAX_ROWS = 64  # rows an INSERT takes at most (SQLite's 999 parameters: 11 a row)
IDLE_CLOSE_S = 1.0
# How long a deletion outlives the response it names: an idempotent retry of its call
# (inference/queue.py IDEM_TTL_S) stores it again within this.
FORGET_STORED_S = 86_400


class Row(NamedTuple):
    """A StoredResponse's columns, already redacted (the field names are the model's)."""

    tenant_id: int
    public_id: str
    created_by: str
    model: str
    status: str
    previous_response_id: str
    input_items: list[dict[str, Any]]
    output_items: list[dict[str, Any]]
    usage: dict[str, Any] | None
    details: dict[str, Any]
    created_at: datetime


_FIELDS: list[Field[Any, Any]] = [
    cast("Field[Any, Any]", StoredResponse._meta.get_field(
        "tenant" if name == "tenant_id" else name)) for name in Row._fields]
_JSON = frozenset(i for i, f in enumerate(_FIELDS) if isinstance(f, JSONField))


@functools.cache
def _insert_sql(vendor: str, rows: int) -> str:
    ops = connection.ops
    # JSON goes as text (orjson's: the JSONField's own adapter cost more than the
    # INSERT), cast where the column is jsonb
    values = "(" + ", ".join("%s::jsonb" if i in _JSON and vendor == "postgresql" else "%s"
                             for i in range(len(_FIELDS))) + ")"
    return (f"{ops.insert_statement(on_conflict=OnConflict.IGNORE)} "
            f"{ops.quote_name(StoredResponse._meta.db_table)} "
            f"({', '.join(ops.quote_name(str(f.column)) for f in _FIELDS)}) VALUES "
            f"{', '.join([values] * rows)} "
            f"{ops.on_conflict_suffix_sql(_FIELDS, OnConflict.IGNORE, None, None) or ''}")


def _params(rows: list[Row]) -> list[Any]:
    return [orjson.dumps(value).decode() if i in _JSON
            else _FIELDS[i].get_db_prep_save(value, connection)
            for row in rows for i, value in enumerate(row)]


def insert(rows: list[Row], announced: list[bool] | None = None) -> None:
    """Write `rows` with one INSERT on this thread's connection (autocommit), then
    delete those a deletion names (`forget`), looking up the rows `announced` marks (by
    default all): a row whose id nobody was given yet cannot be named by a DELETE."""
    with connection.cursor() as cursor:
        cursor.execute(_insert_sql(connection.vendor, len(rows)), _params(rows))
    known = rows if announced is None else [r for r, a in zip(rows, announced, strict=True)
                                            if a]
    gone = _forgotten(known) if known else []
    if gone:
        StoredResponse.objects.filter(public_id__in=gone).delete()


# -- deletions that win over a pending write ------------------------------------------
def _forget_key(tenant_id: int, response_id: str) -> str:
    return f"sluice:{{{tenant_id}}}:response-deleted:{response_id}"


def forget(*, tenant_id: int, response_id: str, subject: str | None, ttl_s: int) -> None:
    """Record that `subject` (None: a tenant admin, who may delete any of the tenant's
    responses) deleted `response_id`, for `ttl_s`. Call before deleting the row: a save
    of that id whose batch looks after this is deleted by the batch, and one whose batch
    looked before this had committed before it, so the caller's delete finds it.
    Raises RedisError."""
    key = _forget_key(tenant_id, response_id)
    with sync_redis().pipeline(transaction=False) as pipe:
        pipe.sadd(key, subject or "*")
        pipe.expire(key, ttl_s, gt=True)
        pipe.expire(key, ttl_s, nx=True)
        pipe.execute()


def _forgotten(rows: list[Row]) -> list[str]:
    """The ids among `rows` that a deletion by their creator or an admin names; those
    deletions are kept for FORGET_STORED_S (a retry of the call would store it again)."""
    with sync_redis().pipeline(transaction=False) as pipe:
        for row in rows:
            pipe.smembers(_forget_key(row.tenant_id, row.public_id))
        found = pipe.execute()
    gone = [row for row, who in zip(rows, found, strict=True)
            if who and ({b"*", row.created_by.encode()} & who)]
    if gone:
        with sync_redis().pipeline(transaction=False) as pipe:
            for row in gone:
                pipe.expire(_forget_key(row.tenant_id, row.public_id), FORGET_STORED_S)
            pipe.execute()
    return [row.public_id for row in gone]


def forget_pending_s() -> int:
    """How long a deletion of an id not stored (yet) must last: a call's reply is saved
    before its deadline ends it, and its save may queue a little behind others."""
    return 2 * int(settings.SLUICE_REQUEST_TIMEOUT_S) + 60


# -- the writer thread ------------------------------------------------------------------
Waiter = tuple[Row, bool, asyncio.AbstractEventLoop, "asyncio.Future[None]"]
_queue: queue.SimpleQueue[Waiter] = queue.SimpleQueue()
_started = threading.Lock()
_thread_pid: int | None = None  # the process whose writer thread runs (a fork has none)


def save(row: Row, *, announced: bool = True) -> asyncio.Future[None]:
    """Write `row` (see the module docstring): a future of the running loop. Only a row
    `announced` (its id given out before this save) is looked up among the deletions."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    _start()
    _queue.put((row, announced, loop, future))
    return future


def pending() -> int:
    """Rows saved and not yet taken by the writer thread."""
    return _queue.qsize()


def _start() -> None:
    global _thread_pid
    if _thread_pid == os.getpid():
        return
    with _started:
        if _thread_pid != os.getpid():
            threading.Thread(target=_run, name="responses-writer", daemon=True).start()
            _thread_pid = os.getpid()


def _run() -> None:
    while True:
        try:
            batch = [_queue.get(timeout=IDLE_CLOSE_S)]
        except queue.Empty:
            _close()
            continue
        while len(batch) < MAX_ROWS:
            try:
                batch.append(_queue.get_nowait())
            except queue.Empty:
                break
        try:
            outcomes = _write([w[0] for w in batch], [w[1] for w in batch])
        except Exception as exc:  # a bug of ours: every save of the batch sees it
            logger.exception("writing stored responses failed")
            outcomes = [exc] * len(batch)
        _close_if_old()  # CONN_MAX_AGE 0: none is kept between batches
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[None],
                                                            BaseException | None]]] = \
            defaultdict(list)
        for (_, _, loop, future), outcome in zip(batch, outcomes, strict=True):
            by_loop[loop].append((future, outcome))
        for loop, settled in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits
                loop.call_soon_threadsafe(_settle, settled)


def _settle(settled: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    for future, outcome in settled:
        if future.done():
            continue  # its caller was cancelled: the row is written all the same
        if outcome is None:
            future.set_result(None)
        else:
            future.set_exception(outcome)


def _close_if_old() -> None:
    """Close the thread's connection past CONN_MAX_AGE or after an error, as Django's
    request handling would (without its SELECT 1 check of a connection it keeps)."""
    if connection.connection is not None and (
            connection.errors_occurred or (connection.close_at is not None
                                           and time.monotonic() >= connection.close_at)):
        _close()


def _close() -> None:
    with contextlib.suppress(*OUTAGE):  # closing a connection the server cut
        connection.close()


def _write(rows: list[Row], announced: list[bool]) -> list[BaseException | None]:
    """What each row's save gets (None: committed)."""
    for attempt in (1, 2):
        _close_if_old()
        try:
            return _insert_each(rows, announced)
        except OUTAGE as exc:
            _close()  # the next try opens a new connection
            if attempt == 2:
                logger.warning("database unavailable: %s", type(exc).__name__)
        except RedisError:
            logger.warning("redis unavailable: the deletions could not be looked up")
            return [queue_unavailable() for _ in rows]
    return [database_unavailable() for _ in rows]


def _insert_each(rows: list[Row], announced: list[bool]) -> list[BaseException | None]:
    """`insert(rows)`; when that fails other than by an outage, each row alone. An
    outage or Redis failing raises."""
    try:
        insert(rows, announced)
        return [None] * len(rows)
    except (*OUTAGE, RedisError):
        raise
    except Exception as exc:
        if len(rows) == 1:
            return [exc]
    outcomes: list[BaseException | None] = []
    for row, known in zip(rows, announced, strict=True):
        try:
            insert([row], [known])
            outcomes.append(None)
        except (*OUTAGE, RedisError):
            raise
        except Exception as exc:
            outcomes.append(exc)
    return outcomes
