"""The audit log: one event per API call and per admin action, redacted, hash-chained
per tenant, written off the hot path.

Writing: `record_call` (the gateway's settlement) and `record_action` (services, on
commit) hand a finished event to the process's `AuditWriter`, a thread that inserts
batches (every FLUSH_S or BATCH events). A batch runs in one transaction that locks the
chains it extends (`AuditChain` rows, SELECT ... FOR UPDATE), so several processes
extend one tenant's chain without forking it. A clean shutdown drains the buffer
(`close()`, also at interpreter exit); a crash loses at most FLUSH_S of events.

Chaining: hash_n = SHA-256(hash_{n-1} || canonical JSON of event n's content); the
first event of a chain follows 64 zeros (or the purge anchor). `verify()` recomputes
every chain and names the first event that does not fit.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import queue
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import close_old_connections, connection, transaction
from django.utils import timezone

from governance.models import AuditChain, AuditEvent
from governance.redaction import redact

logger = logging.getLogger("sluice.audit")
FLUSH_S = 0.2
BATCH = 500
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
    """Redacted first, then cut: a cut never leaves half an identifier behind."""
    if not text:
        return ""
    clean = redact(text, patterns)
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


class AuditWriter:
    def __init__(self) -> None:
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()

    def put(self, event: dict[str, Any]) -> None:
        self._idle.clear()
        self._queue.put(event)
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name="sluice-audit",
                                                    daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while True:
            batch: list[dict[str, Any]] = []
            try:
                item = self._queue.get(timeout=FLUSH_S)
            except queue.Empty:
                if self._queue.empty():
                    self._idle.set()
                continue
            stop = item is None
            if item is not None:
                batch.append(item)
            deadline = time.monotonic() + FLUSH_S
            while not stop and len(batch) < BATCH:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                else:
                    batch.append(item)
            if batch:
                self._write(batch)
            if self._queue.empty():
                self._idle.set()
            if stop:
                return

    def _write(self, batch: list[dict[str, Any]]) -> None:
        for attempt in range(3):
            try:
                write_events(batch)
                return
            except Exception:
                logger.exception("audit batch of %d failed (attempt %d)", len(batch),
                                 attempt + 1)
                close_old_connections()
                time.sleep(0.2 * (attempt + 1))
        logger.error("audit batch of %d events dropped after 3 attempts", len(batch))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything put so far is written."""
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)


def write_events(batch: list[dict[str, Any]]) -> None:
    """Insert events, extending each chain under its row lock."""
    try:
        with transaction.atomic():
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
                fields = {**fields, "seq": head.seq}
                digest = chain_hash(head.last_hash, fields)
                rows.append(AuditEvent(prev_hash=head.last_hash, hash=digest, **fields))
                head.last_hash = digest
            AuditEvent.objects.bulk_create(rows)
            for head in heads.values():
                head.save(update_fields=["seq", "last_hash"])
    finally:
        # The writer thread owns its connection; give it back between batches.
        if threading.current_thread() is not threading.main_thread():
            connection.close()


_writer = AuditWriter()
atexit.register(_writer.close)


def writer() -> AuditWriter:
    return _writer


def _chain_of(tenant_slug: str | None) -> str:
    return tenant_slug or PLATFORM_CHAIN


def record_call(*, principal: Any, action: str, model: str, protocol: str, status: int,
                latency_ms: float, prompt_tokens: int = 0, completion_tokens: int = 0,
                request_id: str = "", trace_id: str = "", request_text: str = "",
                response_text: str = "", detail: dict[str, Any] | None = None,
                patterns: Iterable[tuple[str, re.Pattern[str]]] = ()) -> None:
    """An API call, as the gateway saw it end (or refused it); `patterns`: the tenant's
    own redaction patterns, on top of the built-in recognizers."""
    _writer.put({
        "chain": _chain_of(principal.tenant_slug), "at": timezone.now(),
        "tenant_id": principal.tenant_id, "actor": principal.subject,
        "role": str(principal.role), "key_prefix": principal.key_prefix, "action": action,
        "target": "", "model": redact(model)[:100],  # a refused call's model is input
        "protocol": protocol, "status": status,
        "latency_ms": round(latency_ms, 3), "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens, "request_id": request_id,
        "trace_id": trace_id,
        "request_excerpt": excerpt(request_text, patterns=patterns),
        "response_excerpt": excerpt(response_text, patterns=patterns),
        "detail": _clean(detail or {}),
    })


def record_action(*, actor: Any, action: str, target: str = "", status: int = 200,
                  detail: dict[str, Any] | None = None) -> None:
    """An admin action (a service's write); recorded when the transaction commits."""
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
    transaction.on_commit(lambda: _writer.put(event))


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
