"""Stored responses in Redis: the copy every gateway reads until the database has it.

A stored response reaches Redis one of two ways:
- kept by the worker (`keep`: a job's inference/jobs.Keep), in the write that ends
  its request, before the gateway hears of the end: the gateway's draft (the response
  object's fields the request decides, the input items) and the reply's events, not
  yet redacted; readers and the writer make the row (streaming/apis/responses/rows.py
  `kept_row`, redacting then). The common case: the call adds no write of its own;
- put by the gateway (`put`, streaming/apis/responses/store.py `response_save`) when the
  worker did not keep it (a failed stream's response, a continuation on another
  deployment, a reply the worker did not make whole): the row, redacted, in the call's
  coalesced round trip (sluice.redisdirect Coalescer), one script on a single Redis, two on
  a cluster (the stream is in a slot of its own).

    sluice:{<tenant>}:response:<id>          hash: by (its creator), and row (Row as
                                             JSON) or draft, reply, rid (kept); TTL
                                             COPY_TTL_S, dropped once written
    sluice:responses:stored                  stream of the same (fields "row", or by,
                                             draft, reply, rid) for the writer
                                             (streaming/apis/responses/writer.py)
    sluice:{<tenant>}:response-deleted:<id>  set of who deleted it ("*": an admin)

A reader looks at the copy first, then the database; the writer moves rows into the
database and drops their copies after its commit, so a row is always in one or the
other. A kept copy holds text not yet redacted until the writer writes it (normally
within a second; while the writer is down, as long as COPY_TTL_S), as the queue's jobs
and the requests' event streams hold their text.

A DELETE wins over a save it races, at each step: its script records the deletion and
drops a copy its caller may delete, in one step; a save's script neither copies nor
queues an id its creator or an admin deleted; and the writer, after each INSERT, deletes the rows
a deletion names (`forgotten`). A deletion is kept FORGET_STORED_S once something was
found (an idempotent retry stores the id again within that), `forget_pending_s()` when
nothing was (an id given out by a stream, whose save may still come).

Durability: until the writer commits a row, Redis holds its only copy (the stream
entry and the hash), as it holds the audit stream and the queue: a Redis that loses
its data before then loses those responses. While SLUICE_RESPONSES_REFUSE_AT rows wait
(the writer down or slow), calls that ask to store are refused with a retriable 503
`store_unavailable` (`keeps_up`), so the stream is not trimmed (STREAM_MAXLEN) under
rows nobody wrote.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any, NamedTuple

import orjson
from django.conf import settings
from redis.exceptions import RedisError

from inference import queue as q
from inference.jobs import Keep
from sluice.errors import store_unavailable
from sluice.redis import ScriptBatch, is_cluster, sync_redis
from sluice.redisdirect import Coalescer
from sluice.streamwriter import STREAMS
from sluice.ttlcache import AsyncTTLCache

STREAM = STREAMS["responses"]
STREAM_MAXLEN = 1_000_000  # bounds Redis memory if no writer runs for a long time
# A copy outlives its write by far; it lapses only if no writer runs for this long.
COPY_TTL_S = 7 * 86_400
# How long a deletion outlives the response it names: an idempotent retry of its call
# (inference/queue.py IDEM_TTL_S) stores it again within this.
FORGET_STORED_S = 86_400
_BACKLOG_TTL_S = 1.0  # how stale the backlog used for refusing a save may be
_backlog: AsyncTTLCache[str, int] = AsyncTTLCache(max_entries=1)


class Row(NamedTuple):
    """A StoredResponse's columns, already redacted (the field names are the model's):
    what the copy, the stream entry and the INSERT carry."""

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


def to_wire(row: Row) -> bytes:
    return orjson.dumps(row._asdict())


def from_wire(raw: bytes | str) -> Row:
    """A row from `to_wire`; ValueError or TypeError when it is not one."""
    fields = orjson.loads(raw)
    fields["created_at"] = datetime.fromisoformat(fields["created_at"])
    return Row(**fields)


class Kept(NamedTuple):
    """A reply a worker kept: who called (`by`), the gateway's `draft` (JSON), the
    reply's events (a JSON array) and its request's id (streaming/apis/responses/rows.py
    makes it a Row)."""

    by: str
    draft: bytes
    reply: bytes
    rid: str


def kept_from(fields: dict[bytes, bytes]) -> Kept:
    """The Kept of a copy's hash or a stream entry's fields (KeyError: not one)."""
    return Kept(fields[b"by"].decode(), fields[b"draft"], fields[b"reply"],
                fields[b"rid"].decode())


def copy_key(tenant_id: int, response_id: str) -> str:
    return f"sluice:{{{tenant_id}}}:response:{response_id}"


def forget_key(tenant_id: int, response_id: str) -> str:
    return f"sluice:{{{tenant_id}}}:response-deleted:{response_id}"


# KEYS: deletions, copy. ARGV: who deletes ("*": an admin), the deletion's TTL when no
# copy is dropped, FORGET_STORED_S. Returns 1 when a copy was dropped.
_DELETE_LUA = """
local by = redis.call('HGET', KEYS[2], 'by')
local ttl, dropped = ARGV[2], 0
if by and (ARGV[1] == '*' or by == ARGV[1]) then
  redis.call('DEL', KEYS[2])
  ttl, dropped = ARGV[3], 1
end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ttl, 'GT')
redis.call('EXPIRE', KEYS[1], ttl, 'NX')
return dropped
"""


async def keeps_up(scripts: Coalescer) -> None:
    """Refuse (503 `store_unavailable`) while SLUICE_RESPONSES_REFUSE_AT rows wait for
    the writer: a save then could be trimmed from the stream (STREAM_MAXLEN) and lost.
    One XLEN a second per process; Redis away is the call's own to report."""
    limit = settings.SLUICE_RESPONSES_REFUSE_AT
    if not limit:
        return
    try:
        waiting = await _backlog.get("", lambda: scripts.client.xlen(STREAM), _BACKLOG_TTL_S)
    except RedisError:
        return
    if waiting >= limit:
        raise store_unavailable()


async def put(scripts: Coalescer, row: Row) -> None:
    """Copy `row` for the readers and queue it for the writer, in the call's coalesced
    round trip, as a worker keeps a reply (inference/queue.py KEEP_LUA): one script on a
    single Redis, two on a cluster (the stream is in a slot of its own). Raises
    RedisError."""
    fields: list[str | bytes] = ["row", to_wire(row)]
    keys = [copy_key(row.tenant_id, row.public_id), forget_key(row.tenant_id, row.public_id)]
    args = q.keep_args(row.created_by, COPY_TTL_S, FORGET_STORED_S, STREAM_MAXLEN, fields)
    if not is_cluster(scripts.client):
        await scripts.script(q.KEEP_LUA, [*keys, STREAM], args)
        return
    await asyncio.gather(scripts.script(q.KEEP_LUA, keys, args),
                         scripts.script(q.KEEP_QUEUE_LUA, [STREAM], q.keep_queue_args(
                             row.created_by, STREAM_MAXLEN, fields)))


def keep(tenant_id: int, created_by: str, draft: str) -> Keep:
    """What a call's job carries for its worker to keep its reply (response id
    `resp_<request id>`) with `draft` (streaming/apis/responses/rows.py `keep_draft`)."""
    return Keep(key=copy_key(tenant_id, "resp_"), deletions=forget_key(tenant_id, "resp_"),
                stream=STREAM, by=created_by, draft=draft, ttl_s=COPY_TTL_S,
                forget_s=FORGET_STORED_S, maxlen=STREAM_MAXLEN)


def read(tenant_id: int, response_id: str) -> Row | Kept | None:
    """The copy of a response not yet in the database (None: none): its row, or the
    reply a worker kept. Raises RedisError."""
    fields = sync_redis().hgetall(copy_key(tenant_id, response_id))
    if b"row" in fields:
        return from_wire(fields[b"row"])
    try:
        return kept_from(fields)
    except KeyError:  # none (or not one of ours)
        return None


def forget(*, tenant_id: int, response_id: str, subject: str | None, found: bool) -> bool:
    """Record that `subject` (None: a tenant admin, who may delete any of the tenant's
    responses) deleted `response_id`, and drop its copy if `subject` may; call before
    deleting its row (`found`: whether the database has it). True when a copy was
    dropped. Raises RedisError."""
    batch = ScriptBatch(sync_redis())
    batch.script(_DELETE_LUA, [forget_key(tenant_id, response_id),
                               copy_key(tenant_id, response_id)],
                 [subject or "*", FORGET_STORED_S if found else forget_pending_s(),
                  FORGET_STORED_S])
    return bool(batch.run()[0])


def forgotten(rows: list[Row]) -> list[str]:
    """The ids among `rows` that a deletion by their creator or an admin names; those
    deletions are kept for FORGET_STORED_S more (a retry of the call would store the id
    again). Raises RedisError."""
    with sync_redis().pipeline(transaction=False) as pipe:
        for row in rows:
            pipe.smembers(forget_key(row.tenant_id, row.public_id))
        found = pipe.execute()
    gone = [row for row, who in zip(rows, found, strict=True)
            if who and ({b"*", row.created_by.encode()} & who)]
    if gone:
        with sync_redis().pipeline(transaction=False) as pipe:
            for row in gone:
                pipe.expire(forget_key(row.tenant_id, row.public_id), FORGET_STORED_S)
            pipe.execute()
    return [row.public_id for row in gone]


def forget_pending_s() -> int:
    """How long a deletion of an id not stored (yet) must last: a call's reply is saved
    before its deadline ends it."""
    return 2 * int(settings.SLUICE_REQUEST_TIMEOUT_S) + 60
