"""The stored responses' writer: rows from the Redis stream into the database, in batches.

    manage.py responseswriter        # until SIGTERM/SIGINT; several may run

The gateway puts each stored response in Redis (streaming/responses_copy.py: a copy the
readers find, and an entry of the stream `sluice:responses:stored`); this process moves
them into PostgreSQL off the calls' path, as the audit writer moves audit events
(governance/audit.py), in the same way:
- a consumer group hands each entry to one writer; a writer takes up to BATCH entries
  at a time (after a partial batch it lingers LINGER_S, so a busy stream is written in
  a few large batches) and writes them in one transaction (`insert`: one constant
  statement for every row, no model instances);
- entries are acknowledged (and deleted) only after their rows are committed; a
  writer's entries left unacknowledged (it crashed) are claimed by another after
  CLAIM_IDLE_MS, its own after a failed batch at once. The INSERT ignores an id
  already stored (ON CONFLICT DO NOTHING): a redelivered entry, or an idempotent retry
  that stored the id again, writes nothing;
- after its INSERT a batch deletes the rows a deletion names
  (responses_copy.forgotten), then drops the rows' copies: a row is in Redis, in the
  database, or in both for a moment, never in neither;
- a database outage or Redis failing fails the batch (retried, nothing acknowledged); a
  row the database refuses (its tenant deleted since) is logged and dropped alone.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from typing import Any, cast

import orjson
from django.db import close_old_connections, connection, transaction
from django.db.models import Field, JSONField
from django.db.models.constants import OnConflict
from redis import exceptions as redis_errors

from sluice.db import OUTAGE
from sluice.redis import sync_redis
from streaming.models import StoredResponse
from streaming.responses_copy import STREAM, Row, copy_key, forgotten, from_wire

logger = logging.getLogger(__name__)
GROUP = "writers"
BATCH = 500  # entries a batch takes at most
LINGER_S = 0.1
CLAIM_IDLE_MS = 60_000
_FIELDS: list[Field[Any, Any]] = [
    cast("Field[Any, Any]", StoredResponse._meta.get_field(
        "tenant" if name == "tenant_id" else name)) for name in Row._fields]
_JSON = frozenset(i for i, f in enumerate(_FIELDS) if isinstance(f, JSONField))


@functools.cache
def _insert_sql(vendor: str) -> str:
    ops = connection.ops
    # JSON goes as text (orjson's: the JSONField's own adapter costs more than the
    # INSERT), cast where the column is jsonb
    values = "(" + ", ".join("%s::jsonb" if i in _JSON and vendor == "postgresql" else "%s"
                             for i in range(len(_FIELDS))) + ")"
    return (f"{ops.insert_statement(on_conflict=OnConflict.IGNORE)} "
            f"{ops.quote_name(StoredResponse._meta.db_table)} "
            f"({', '.join(ops.quote_name(str(f.column)) for f in _FIELDS)}) VALUES "
            f"{values} "
            f"{ops.on_conflict_suffix_sql(_FIELDS, OnConflict.IGNORE, None, None) or ''}")


def _params(rows: list[Row]) -> list[Any]:
    return [orjson.dumps(value).decode() if i in _JSON
            else _FIELDS[i].get_db_prep_save(value, connection)
            for row in rows for i, value in enumerate(row)]


def insert(rows: list[Row]) -> None:
    """Write `rows` (ids already stored are skipped) on this thread's connection in one
    transaction: one INSERT statement run for every row (psycopg sends them in one
    pipeline; a multi-row VALUES statement cost more, its long SQL parsed again by the
    client each time), then delete those a deletion names. Raises what the database or
    Redis raise."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.executemany(_insert_sql(connection.vendor), [_params([r]) for r in rows])
    gone = forgotten(rows)
    if gone:
        StoredResponse.objects.filter(public_id__in=gone).delete()


def _insert_each(rows: list[Row]) -> None:
    """`insert(rows)`; when the database refuses the batch, each row alone, dropping
    (logged) a row it refuses alone. An outage or Redis failing raises."""
    try:
        insert(rows)
        return
    except (*OUTAGE, redis_errors.RedisError):
        raise
    except Exception:
        if len(rows) == 1:
            logger.exception("stored response %s refused by the database; dropped",
                             rows[0].public_id)
            return
    for row in rows:
        _insert_each([row])


class Writer:
    """Moves stored responses from the stream into the database (see the module
    docstring). `claim_idle_ms`: how long another writer's entry waits unacknowledged
    before this one takes it over."""

    def __init__(self, name: str | None = None, batch: int = BATCH,
                 claim_idle_ms: int = CLAIM_IDLE_MS) -> None:
        self.redis = sync_redis()
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.batch, self.claim_idle_ms = batch, claim_idle_ms
        self._own_pending = True  # at start: what this name took before a restart
        try:
            self.redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        except redis_errors.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _entries(self, block_ms: int | None) -> list[tuple[Any, dict[bytes, bytes]]]:
        """This writer's unacknowledged entries after a failure, others' stale ones,
        then new ones: at most `batch`."""
        entries: list[tuple[Any, dict[bytes, bytes]]] = []
        if self._own_pending:
            for _stream, items in self.redis.xreadgroup(
                    GROUP, self.name, {STREAM: "0"}, count=self.batch) or []:
                entries += items
            self._own_pending = len(entries) == self.batch
        if len(entries) < self.batch:
            _, stale, _ = self.redis.xautoclaim(STREAM, GROUP, self.name, self.claim_idle_ms,
                                                count=self.batch - len(entries))
            entries += stale
        if not entries:
            for _stream, items in self.redis.xreadgroup(
                    GROUP, self.name, {STREAM: ">"}, count=self.batch, block=block_ms) or []:
                entries += items
        return entries

    def run_once(self, block_ms: int | None = None) -> int:
        """One batch. Returns the entries done (written, or dropped as malformed)."""
        entries = self._entries(block_ms)
        if not entries:
            return 0
        rows: dict[str, Row] = {}  # by id: an id twice in a batch is written once
        for entry_id, fields in entries:
            try:
                row = from_wire(fields[b"row"])
            except (KeyError, ValueError, TypeError):
                logger.error("stored responses' entry %s is malformed; dropped", entry_id)
                continue
            rows.setdefault(row.public_id, row)
        try:
            if rows:
                _insert_each(list(rows.values()))
        except BaseException:
            self._own_pending = True  # retried by this writer's next batch
            raise
        ids = [entry_id for entry_id, _ in entries]
        with self.redis.pipeline(transaction=False) as pipe:
            for row in rows.values():
                pipe.delete(copy_key(row.tenant_id, row.public_id))
            pipe.xack(STREAM, GROUP, *ids)
            pipe.xdel(STREAM, *ids)
            pipe.execute()
        return len(entries)

    def serve(self, stop: threading.Event, block_ms: int = 1000,
              linger_s: float = LINGER_S) -> None:
        while not stop.is_set():
            try:
                done = self.run_once(block_ms)
            except Exception:
                logger.exception("stored responses' writer: batch failed; retrying")
                close_old_connections()
                stop.wait(1.0)
                continue
            close_old_connections()  # CONN_MAX_AGE, as a request's connection
            if 0 < done < self.batch:
                # Group commit: let the next batch gather for a moment (each INSERT
                # costs a round trip and a commit).
                stop.wait(linger_s)


def drain(settle_s: float = 0.3, timeout_s: float = 30.0) -> int:
    """Write everything in the stream now, until it stays empty for `settle_s` (tests,
    and operators before a maintenance)."""
    writer = Writer(name=f"drain-{os.getpid()}", claim_idle_ms=0)
    done, quiet_since = 0, time.monotonic()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = writer.run_once(block_ms=50)
        done += n
        if n:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= settle_s:
            break
    return done
