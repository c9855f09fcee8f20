"""The stored responses' writer: rows from the Redis stream into the database, in batches.

    manage.py responseswriter        # until SIGTERM/SIGINT; several may run

Each stored response is in Redis (streaming/apis/responses/copy.py: a copy the readers
find, and an entry of the stream `sluice:responses:stored`: a row the gateway made, or
a reply a worker kept, which this process makes a row, redacting it); this process
moves them into PostgreSQL off the calls' path with the loop the audit writer uses
(sluice/streamwriter.py: a consumer group, batches of up to 500 written in one
transaction, entries acknowledged only after commit, a dead writer's entries claimed):
- a batch is written by `insert`: one constant statement for every row, no model
  instances. The INSERT ignores an id already stored (ON CONFLICT DO NOTHING): a
  redelivered entry, or an idempotent retry that stored the id again, writes nothing;
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
from typing import Any, cast

import orjson
from django.db import connection, transaction
from django.db.models import Field, JSONField
from django.db.models.constants import OnConflict
from redis import exceptions as redis_errors

from governance.privacy import redactor_now
from sluice.db import OUTAGE
from sluice.streamwriter import Entry, StreamWriter
from streaming.apis.responses.copy import STREAM, Row, copy_key, forgotten, from_wire, kept_from
from streaming.apis.responses.rows import kept_row
from streaming.models import StoredResponse

logger = logging.getLogger(__name__)
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


class Writer(StreamWriter):
    """Moves stored responses from the stream into the database (see the module
    docstring and sluice/streamwriter.py)."""

    STREAM = STREAM
    WHAT = "stored responses' writer"

    def write(self, entries: list[Entry]) -> list[str]:
        rows: dict[str, Row] = {}  # by id: an id twice in a batch is written once
        redactor_of = functools.cache(redactor_now)  # each tenant's policy, read once
        for entry_id, fields in entries:
            try:
                row = from_wire(fields[b"row"]) if b"row" in fields \
                    else kept_row(kept_from(fields), redactor_of)
            except (KeyError, ValueError, TypeError):
                logger.error("stored responses' entry %s is malformed; dropped", entry_id)
                continue
            rows.setdefault(row.public_id, row)
        if rows:
            _insert_each(list(rows.values()))
        return [copy_key(row.tenant_id, row.public_id) for row in rows.values()]


def drain(settle_s: float = 0.3, timeout_s: float = 30.0) -> int:
    """Write everything in the stream now, until it stays empty for `settle_s` (tests,
    and operators before a maintenance)."""
    writer = Writer(name=f"drain-{os.getpid()}", claim_idle_ms=0)
    return writer.drain(settle_s, timeout_s)
