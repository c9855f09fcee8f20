"""The audit log: one event per API call and per admin action, redacted, hash-chained
per tenant, written off the hot path.

Writing is two-staged, so that no gateway spends its CPU on database inserts: events
(redacted where they are made) are appended to a Redis stream — the gateway's in its
governance recorder's pipeline, every 100 ms; services' on commit — and a writer process
(`manage.py auditwriter`, started by the run command) moves them into the database in
batches. A batch runs in one transaction that locks the chains it extends (`AuditChain`
rows, SELECT ... FOR UPDATE), so several writers extend a chain without forking it.
Entries are acknowledged after their batch commits and carry their stream id into the
row (`source`, unique), so a writer crash loses nothing and a redelivery inserts
nothing twice. A gateway crash loses at most its last 100 ms of events.

Chaining: hash_n = SHA-256(hash_{n-1} || canonical JSON of event n's content); the
first event of a chain follows 64 zeros (or the purge anchor). `verify()` recomputes
every chain and names the first event that does not fit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from secrets import token_hex
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.utils import timezone

from governance.models import AuditChain, AuditEvent
from sluice import wirejson
from sluice.pii.redaction import redact
from sluice.redis import sync_redis
from sluice.streamwriter import STREAMS, Entry, StreamWriter

logger = logging.getLogger("sluice.audit")
EXCERPT_CHARS = 500
PLATFORM_CHAIN = "platform"
GENESIS = "0" * 64

# The fields the hash covers, in this order (everything but the chain bookkeeping).
HASHED = ("chain", "seq", "at", "tenant_id", "actor", "role", "key_prefix", "action",
          "target", "model", "protocol", "status", "latency_ms", "prompt_tokens",
          "completion_tokens", "request_id", "trace_id", "request_excerpt",
          "response_excerpt", "detail")


def excerpt(text: str | None, limit: int = EXCERPT_CHARS,
            patterns: Iterable[tuple[str, re.Pattern[str]]] = ()) -> str:
    """Redacted first, then cut: a cut never leaves half an identifier behind. A NUL
    becomes U+FFFD: PostgreSQL cannot store it, and one event the writer cannot insert
    would fail every batch after it (the stream keeps redelivering it)."""
    if not text:
        return ""
    clean = redact(text, patterns).replace("\x00", "\ufffd")
    return clean if len(clean) <= limit else clean[:limit] + "…"


_FLOATS = {"latency_ms"}
_INTS = {"seq", "status", "prompt_tokens", "completion_tokens"}


def canonical(fields: dict[str, Any]) -> bytes:
    """The hashed content, typed the way the database gives it back (an int latency
    written is a float read)."""
    values = []
    for name in HASHED:
        value = fields.get(name)
        if isinstance(value, datetime):
            value = value.astimezone(UTC).isoformat(timespec="microseconds")
        elif name in _FLOATS:
            value = float(value or 0)
        elif name in _INTS:
            value = int(value or 0)
        values.append(value)
    return json.dumps(values, sort_keys=True, separators=(",", ":"), default=str).encode()


def chain_hash(prev: str, fields: dict[str, Any]) -> str:
    return hashlib.sha256(prev.encode() + canonical(fields)).hexdigest()


def _fields_of(event: AuditEvent) -> dict[str, Any]:
    return {name: getattr(event, name) for name in HASHED}


STREAM = STREAMS["audit"]
STREAM_MAXLEN = 1_000_000  # bounds Redis memory if no writer runs for a long time


def new_source() -> str:
    """A `source` id for an event that may be appended to the stream more than once (a
    retried write): the writer stores each source once. Without one, an event's stream
    entry id is its source."""
    return f"ev-{token_hex(12)}"


def to_wire(event: dict[str, Any]) -> str:
    return wirejson.dumps({**event, "at": event["at"].isoformat()}, default=str)


def from_wire(raw: bytes | str) -> dict[str, Any]:
    event = json.loads(raw)
    event["at"] = datetime.fromisoformat(event["at"])
    return event


def emit(event: dict[str, Any]) -> None:
    """Append an event to the audit stream now (sync callers; the gateway batches its
    events in the governance recorder's pipeline instead)."""
    sync_redis().xadd(STREAM, {"e": to_wire(event)}, maxlen=STREAM_MAXLEN, approximate=True)


def write_events(batch: list[dict[str, Any]]) -> int:
    """Insert events, extending each chain under its row lock. Events carry a `source`
    id (their own, or their stream entry id); one already stored (a redelivery, a
    retried write) is skipped. Returns rows written."""
    with transaction.atomic():
        sources = [e["source"] for e in batch if e.get("source")]
        seen = set(AuditEvent.objects.filter(source__in=sources).values_list(
            "source", flat=True)) if sources else set()
        fresh = []
        for event in batch:  # stored already, or twice in this batch: once
            if event.get("source"):
                if event["source"] in seen:
                    continue
                seen.add(event["source"])
            fresh.append(event)
        batch = fresh
        if not batch:
            return 0
        names = sorted({e["chain"] for e in batch})
        for name in names:
            AuditChain.objects.get_or_create(chain=name)
        heads = {c.chain: c for c in
                 AuditChain.objects.select_for_update().filter(chain__in=names)
                 .order_by("chain")}
        rows = []
        for fields in batch:
            head = heads[fields["chain"]]
            head.seq += 1
            row = {**fields, "seq": head.seq}
            digest = chain_hash(head.last_hash, row)
            row["prev_hash"], row["hash"] = head.last_hash, digest
            rows.append(row)
            head.last_hash = digest
        _insert(rows)
        for head in heads.values():
            head.save(update_fields=["seq", "last_hash"])
        stored_alerts = [r["source"] for r in rows if r["action"] == "budget.alert"]
        if stored_alerts:
            from governance import alerts  # its webhooks go out once the alerts are stored
            # robust: a broker away loses those webhooks (logged), never the writer
            transaction.on_commit(lambda: alerts.enqueue(stored_alerts), robust=True)
        return len(rows)


# Field types whose database value is the Python value itself when it has exactly this
# type (Django's own preparation returns it unchanged on SQLite and PostgreSQL): those
# skip `get_db_prep_save`, which with its helpers had been 40% of the writer's CPU.
# Integers are not among them: on PostgreSQL Django wraps them in psycopg's sized types.
_UNCHANGED = {"CharField": str, "TextField": str, "FloatField": float}


def _insert(rows: list[dict[str, Any]]) -> None:
    """What `bulk_create` of these rows does, in one executemany: each value prepared by
    its field (`get_db_prep_save`: datetimes, JSON), a missing one given its default,
    without building model instances and compiling the INSERT per batch (those were
    ~40% of the audit writer's CPU). A value that Django would pass through unchanged
    (`_UNCHANGED`) is passed as is. An unknown field is a TypeError, as in the model."""
    fields = [f for f in AuditEvent._meta.concrete_fields if f is not AuditEvent._meta.pk]
    names = {f.attname for f in fields}
    for row in rows:
        unknown = set(row) - names
        if unknown:
            raise TypeError(f"AuditEvent has no field(s) {sorted(unknown)}")
    db = connections[DEFAULT_DB_ALIAS]  # the wrapper itself, not the per-access proxy
    quote = db.ops.quote_name
    sql = (f"INSERT INTO {quote(AuditEvent._meta.db_table)} "  # noqa: S608 (the model's names)
           f"({', '.join(quote(str(f.column)) for f in fields)}) "
           f"VALUES ({', '.join(['%s'] * len(fields))})")
    plan = [(f.attname, f, _UNCHANGED.get(f.get_internal_type())) for f in fields]
    params = []
    for row in rows:
        values = []
        for name, field, kind in plan:
            value = row[name] if name in row else field.get_default()
            if kind is None or type(value) is not kind:
                value = field.get_db_prep_save(value, db)
            values.append(value)
        params.append(values)
    with db.cursor() as cursor:
        cursor.executemany(sql, params)


class Consumer(StreamWriter):
    """Moves events from the stream into the database in batches (`manage.py
    auditwriter`, which the run command starts), with sluice/streamwriter.py's loop:
    several may run, each entry goes to one, a dead consumer's entries are claimed, an
    entry is acknowledged only after its batch committed (at least once; the `source`
    id makes the insert idempotent)."""

    STREAM = STREAM
    WHAT = "audit writer"

    def write(self, entries: list[Entry]) -> list[str]:
        events = []
        for entry_id, fields in entries:
            try:
                event = from_wire(fields[b"e"])
            except (KeyError, ValueError):
                logger.error("audit stream entry %s is malformed; dropped", entry_id)
                continue
            if not event.get("source"):
                event["source"] = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            events.append(event)
        write_events(events)
        return []


def drain(settle_s: float = 0.3, timeout_s: float = 30.0) -> int:
    """Write everything in the stream now, until it stays empty for `settle_s` (tests,
    and operators before a verification)."""
    return Consumer(name=f"drain-{os.getpid()}").drain(settle_s, timeout_s)


def _chain_of(tenant_slug: str | None) -> str:
    return tenant_slug or PLATFORM_CHAIN


def call_event(*, principal: Any, action: str, model: str, protocol: str, status: int,
               latency_ms: float, prompt_tokens: int = 0, completion_tokens: int = 0,
               request_id: str = "", trace_id: str = "", request_text: str = "",
               response_text: str = "", detail: dict[str, Any] | None = None,
               patterns: Iterable[tuple[str, re.Pattern[str]]] = ()) -> dict[str, Any]:
    """An API call as an audit event, redacted (`patterns`: the tenant's own, on top of
    the built-in recognizers)."""
    return {
        "chain": _chain_of(principal.tenant_slug), "at": timezone.now(),
        "tenant_id": principal.tenant_id, "actor": principal.subject,
        "role": str(principal.role), "key_prefix": principal.key_prefix, "action": action,
        # A refused call's model is input: redacted, and storable (no NUL).
        "target": "", "model": redact(model)[:100].replace("\x00", "\ufffd"),
        "protocol": protocol, "status": status,
        "latency_ms": round(latency_ms, 3), "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens, "request_id": request_id,
        "trace_id": trace_id,
        "request_excerpt": excerpt(request_text, patterns=patterns),
        "response_excerpt": excerpt(response_text, patterns=patterns),
        "detail": _clean(detail or {}),
    }


def record_call(**kwargs: Any) -> None:
    """An API call, from sync code (the gateway batches `call_event`s instead)."""
    emit(call_event(**kwargs))


def record_action(*, actor: Any, action: str, target: str = "", status: int = 200,
                  detail: dict[str, Any] | None = None) -> None:
    """An admin action (a service's write); emitted when the transaction commits."""
    event = {
        "chain": _chain_of(getattr(actor, "tenant_slug", None)), "at": timezone.now(),
        "tenant_id": getattr(actor, "tenant_id", None),
        "actor": getattr(actor, "subject", "system"), "role": str(getattr(actor, "role", "")),
        "key_prefix": getattr(actor, "key_prefix", ""), "action": action,
        "target": redact(target)[:200], "model": "", "protocol": "admin", "status": status,
        "latency_ms": 0.0, "prompt_tokens": 0, "completion_tokens": 0, "request_id": "",
        "trace_id": "", "request_excerpt": "", "response_excerpt": "",
        "detail": _clean(detail or {}),
    }

    def send() -> None:
        try:
            emit(event)
        except Exception:  # the action happened; losing its record must be loud
            logger.exception("audit event for %s could not be queued", action)

    transaction.on_commit(send)


def _clean(detail: dict[str, Any]) -> dict[str, Any]:
    """Detail values redacted (strings) and kept small."""
    out: dict[str, Any] = {}
    for key, value in list(detail.items())[:32]:
        if isinstance(value, str):
            out[key] = excerpt(value, 200)
        elif isinstance(value, int | float | bool) or value is None:
            out[key] = value
        else:
            out[key] = excerpt(json.dumps(value, default=str), 200)
    return out


# -- verification and retention ------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    chain: str
    seq: int
    event_id: int | None
    reason: str


def verify(chain: str | None = None) -> list[Problem]:
    """Recompute every chain (or one); the first bad event of each chain is reported."""
    problems: list[Problem] = []
    heads = AuditChain.objects.all() if chain is None else AuditChain.objects.filter(
        chain=chain)
    for head in heads.order_by("chain"):
        prev, expected = head.anchor_hash, head.anchor_seq + 1
        for event in AuditEvent.objects.filter(chain=head.chain).order_by("seq").iterator(
                chunk_size=2000):
            reason = None
            if event.seq != expected:
                reason = f"sequence gap: expected {expected}, found {event.seq}"
            elif event.prev_hash != prev:
                reason = "prev_hash does not match the previous event"
            elif chain_hash(prev, _fields_of(event)) != event.hash:
                reason = "content does not match its hash (altered)"
            if reason is not None:
                problems.append(Problem(head.chain, event.seq, event.pk, reason))
                break
            prev, expected = event.hash, expected + 1
        else:
            if expected - 1 != head.seq:
                problems.append(Problem(head.chain, expected, None,
                                        f"chain ends at {expected - 1}, head says "
                                        f"{head.seq} (events missing at the end)"))
    return problems


def purge(older_than: datetime) -> int:
    """Delete each chain's events older than `older_than` (a prefix of the chain), and
    move its anchor to the last deleted event, so what stays still verifies."""
    removed = 0
    for head in AuditChain.objects.order_by("chain"):
        with transaction.atomic():
            locked = AuditChain.objects.select_for_update().get(pk=head.pk)
            last = (AuditEvent.objects.filter(chain=locked.chain, at__lt=older_than)
                    .order_by("-seq").first())
            if last is None:
                continue
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    cursor.execute("SET LOCAL sluice.audit_purge = 'on'")
            with connection.cursor() as cursor:
                cursor.execute(f"DELETE FROM {AuditEvent._meta.db_table} "  # noqa: S608
                               "WHERE chain = %s AND seq <= %s", [locked.chain, last.seq])
                removed += cursor.rowcount
            locked.anchor_seq, locked.anchor_hash = last.seq, last.hash
            locked.save(update_fields=["anchor_seq", "anchor_hash"])
    return removed
