"""Stored responses of the Responses API: services and selectors.

A response created with `store` (the default) is kept as a StoredResponse: its own input
items, its output items, its usage and the rest of its response object. Its text (item
text, function arguments and outputs, instructions, metadata) is redacted per the
tenant's policy before it is written (governance/privacy.py), as conversation turns are.

Who reads one: the same rule as conversations (tenants/conversations.py): its creator,
or the tenant's admins (who manage every conversation); an auditor, who may not call
models, none. Another tenant's response, another member's, one past the tenant's
retention (tenants/privacy.py) or a malformed id are all the same NotFound. A new call's
`previous_response_id` is looked up by the same rule; the chain behind it is followed
as far as its links are readable (a deleted or expired response ends it). The retention
task deletes what is past retention (`responses_purge`).

Where a stored response is: in Redis first (streaming/apis/responses/copy.py), kept there by
the worker with the request's final event (the call's job carries the draft:
`response_keep`) or, when the worker did not keep it, put there by the call's save
(`response_save`); a writer process moves it into the database in batches
(streaming/apis/responses/writer.py), dropping the copy once it is committed; every reader
looks at the copy first, then the database, so a response is readable from every
gateway process as soon as its caller has the reply. A DELETE
wins over a save it races (`response_delete`). Until the writer commits it, a response
is only in Redis (as the audit stream's events and the queue's jobs are).
"""

from __future__ import annotations

import itertools
import re
from datetime import datetime
from typing import Any, NamedTuple

from django.db import connection
from django.db.models import QuerySet
from redis.exceptions import RedisError

from governance.privacy import redactor, redactor_now
from inference.jobs import Keep
from sluice.errors import NotFound
from sluice.redisdirect import Coalescer
from streaming.apis.responses import copy as responses_copy
from streaming.apis.responses.copy import Kept
from streaming.apis.responses.rows import keep_draft, kept_row, row
from streaming.apis.responses.writer import insert
from streaming.models import StoredResponse
from streaming.pipeline.failures import queue_unavailable
from tenants.principal import Principal
from tenants.privacy import policy_of, retention_groups
from tenants.roles import Action
from tenants.selectors import owned, require

RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{24}$")
MAX_CHAIN = 256  # responses followed back from a previous_response_id, at most


class _Scope(NamedTuple):
    """What an actor may read: `rows`, the responses in the database it may read;
    `cutoff`, the tenant's retention (older ones are gone)."""

    actor: Principal
    rows: QuerySet[StoredResponse]
    cutoff: datetime


def _scoped(actor: Principal) -> _Scope:
    cutoff = policy_of(actor.tenant_id).cutoff()
    found = owned(actor, StoredResponse.objects.all(),
                  manage_all=Action.CONVERSATION_MANAGE_ALL, manage_own=Action.MODEL_USE)
    return _Scope(actor, found.filter(created_at__gte=cutoff), cutoff)


def _missing(param: str | None = None) -> NotFound:
    if param == "previous_response_id":
        return NotFound("Previous response not found.", code="previous_response_not_found",
                        param=param)
    return NotFound("No such response.", code="response_not_found")


def _copied(scope: _Scope, response_id: str) -> tuple[bool, StoredResponse | None]:
    """Whether Redis holds a copy of the response (not written to the database yet), and
    the copy if the scope's actor may read it (the same rules as the scope's rows)."""
    actor = scope.actor
    try:
        copy = responses_copy.read(actor.tenant_id, response_id)
    except RedisError:
        raise queue_unavailable() from None
    if copy is None:
        return False, None
    if isinstance(copy, Kept):
        try:
            copy = kept_row(copy, redactor_now)
        except (ValueError, TypeError, KeyError):  # not what a worker keeps: unreadable
            return True, None
    mine = actor.can(Action.CONVERSATION_MANAGE_ALL) or copy.created_by == actor.subject
    if not mine or copy.created_at < scope.cutoff:
        return True, None
    return True, StoredResponse(**copy._asdict())


def _find(scope: _Scope, response_id: str) -> StoredResponse | None:
    """The response if the scope's actor may read it: its copy in Redis (not written
    yet), else its row."""
    if not RESPONSE_ID.match(response_id):
        return None
    there, copy = _copied(scope, response_id)
    return copy if there else scope.rows.filter(public_id=response_id).first()


# The ids of a chain as the database has it, newest first: the row `public_id`, then
# each row its `previous_response_id` names, while there is one (the tenant's, whoever
# created it), at most `depth` + 1.
_CHAIN_SQL = """
WITH RECURSIVE chain(public_id, previous_response_id, depth) AS (
    SELECT public_id, previous_response_id, 0 FROM {table}
    WHERE tenant_id = %s AND public_id = %s
  UNION ALL
    SELECT r.public_id, r.previous_response_id, c.depth + 1 FROM {table} r
    JOIN chain c ON r.public_id = c.previous_response_id
    WHERE r.tenant_id = %s AND c.depth < %s
)
SELECT public_id FROM chain ORDER BY depth
"""


def _links(scope: _Scope, response_id: str, limit: int) -> tuple[list[StoredResponse], bool]:
    """The responses the scope's actor may read from `response_id` back along its chain, newest
    first, as far as one look finds them: its copy in Redis, else the rows of the
    database's part of the chain (two queries, however long), at most `limit`; and
    whether the chain may go on past the last (its previous link is elsewhere: in
    Redis, or past `limit`), False when a link is missing or unreadable."""
    if not RESPONSE_ID.match(response_id):
        return [], False
    there, copy = _copied(scope, response_id)
    if there:
        return ([copy], True) if copy is not None else ([], False)
    tenant_id = scope.actor.tenant_id
    with connection.cursor() as cursor:
        cursor.execute(_CHAIN_SQL.format(table=StoredResponse._meta.db_table),
                       [tenant_id, response_id, tenant_id, limit - 1])
        ids = [public_id for (public_id,) in cursor.fetchall()]
    rows = {row.public_id: row for row in scope.rows.filter(public_id__in=ids)}
    found = [rows[i] for i in itertools.takewhile(rows.__contains__, ids)]
    return found, bool(ids) and len(found) == len(ids)


def response_get(*, actor: Principal, response_id: str) -> StoredResponse:
    found = _find(_scoped(actor), response_id)
    if found is None:
        raise _missing()
    return found


def response_body(row: StoredResponse) -> dict[str, Any]:
    """The stored response as the Responses API's response object."""
    return {**row.details, "id": row.public_id, "object": "response",
            "created_at": int(row.created_at.timestamp()), "status": row.status,
            "model": row.model, "output": row.output_items, "usage": row.usage,
            "previous_response_id": row.previous_response_id or None, "store": True}


def response_input_items(*, actor: Principal, response_id: str) -> list[dict[str, Any]]:
    """The response's own input items, in the order they were given."""
    return list(response_get(actor=actor, response_id=response_id).input_items)


def response_delete(*, actor: Principal, response_id: str) -> str:
    """Delete a stored response, from Redis and the database; a DELETE wins over a save
    of that id in flight (a stream's reply, known from its first event, or an
    idempotent retry's), also when nothing is stored yet (NotFound all the same): the
    deletion is recorded first (streaming/apis/responses/copy.py `forget`), then the row
    deleted."""
    scoped = _scoped(actor).rows  # the rights first: a refused caller records nothing
    if RESPONSE_ID.match(response_id):
        found = scoped.filter(public_id=response_id).exists()
        try:
            dropped = responses_copy.forget(
                tenant_id=actor.tenant_id, response_id=response_id,
                subject=None if actor.can(Action.CONVERSATION_MANAGE_ALL) else actor.subject,
                found=found)
        except RedisError:
            raise queue_unavailable() from None
        if scoped.filter(public_id=response_id).delete()[0] or dropped:
            return response_id
    raise _missing()


def response_context(*, actor: Principal, response_id: str) -> list[dict[str, Any]]:
    """The items a call continuing `response_id` starts from: every response of its chain,
    oldest first, each its input then its output. NotFound (naming
    previous_response_id) unless the actor may read `response_id` itself. A few round
    trips however long the chain: one per stretch of it in Redis or in the database."""
    scope = _scoped(actor)
    chain, goes_on = _links(scope, response_id, MAX_CHAIN)
    if not chain:
        raise _missing("previous_response_id")
    while goes_on and chain[-1].previous_response_id and len(chain) < MAX_CHAIN:
        before, goes_on = _links(scope, chain[-1].previous_response_id,
                                 MAX_CHAIN - len(chain))
        chain += before
    return [item for r in reversed(chain) for item in (*r.input_items, *r.output_items)]


def response_create(*, actor: Principal, body: dict[str, Any],
                    input_items: list[dict[str, Any]]) -> StoredResponse:
    """Store a response object `body` and the call's own `input_items`, redacted per the
    tenant's policy (read now), in the database at once (sync callers: services, tests);
    storing an id again stores nothing. The row as stored (unsaved instance)."""
    require(actor, Action.MODEL_USE)
    made = row(actor.tenant_id, actor.subject, body, input_items,
               redactor_now(actor.tenant_id))
    insert([made])
    return StoredResponse(**made._asdict())


def response_keep(*, actor: Principal, head: dict[str, Any],
                  input_items: list[dict[str, Any]]) -> Keep:
    """What a call's job carries for its worker to store its response (inference/jobs.py
    Keep): the response object's fields the request decides (`head`) and the call's own
    input items, redacted when a reader or the writer makes them a row. The response
    is stored when the final event says `kept_at`; else the call stores it
    (`response_save`). The call's admission checks the actor's right to call models."""
    return responses_copy.keep(actor.tenant_id, actor.subject,
                               keep_draft(actor.tenant_id, head, input_items))


async def response_save(*, actor: Principal, body: dict[str, Any],
                        input_items: list[dict[str, Any]], scripts: Coalescer) -> None:
    """Store a response from the call's path, with the tenant's cached redaction policy:
    put in Redis on the call's coalescer (`scripts`, the gateway's), readable from every
    process when this returns; a writer process puts it in the database. Redis failing
    is the queue's retriable 503."""
    require(actor, Action.MODEL_USE)
    made = row(actor.tenant_id, actor.subject, body, input_items,
               await redactor(actor.tenant_id))
    try:
        await responses_copy.put(scripts, made)
    except RedisError:
        raise queue_unavailable() from None


def responses_purge(now: datetime | None = None) -> int:
    """Delete stored responses older than their tenant's retention. Idempotent (by age
    only)."""
    deleted = 0
    for group in retention_groups(now):
        deleted += StoredResponse.objects.filter(
            group.tenants(), created_at__lt=group.cutoff).delete()[0]
    return deleted
