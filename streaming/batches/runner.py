"""The batch runner: a batch runs as a chain of short Celery tasks, one chunk each
(`streaming.tasks.run_batch` calls `run_chunk` and enqueues the next with the countdown
it returns). No task ever waits inside itself, so one tenant's batch cannot hold the
batch worker from another's.

A chunk, in order:
1. takes the tenant's chunk lock (Redis, `{tenant}` slot, LOCK_TTL_S, renewed while the
   chunk runs): at most one running chunk per tenant. Held by another chunk: come back
   in BUSY_RETRY_S.
2. reads the batch's status under its row lock: a terminal batch is left alone; a
   cancelling one ends `cancelled`; one past `expires_at` ends `expired`.
3. resolves the creator's identity again (streaming/batches/identity.py): revoked, the
   batch ends `failed` with `credential_revoked` and runs no more lines.
4. the first chunk validates the file (streaming/batches/lines.py) and writes the error
   lines of unreadable lines; a file that fails validation ends the batch `failed`.
5. sends the next SLUICE_BATCH_CHUNK_LINES lines not yet done, CONCURRENCY at a time,
   through the gateway pipeline, for at most SLUICE_BATCH_CHUNK_S. About every
   WATCH_S it renews its lock, re-reads the status and resolves the identity again:
   a cancel or a revocation stops it from starting more lines.
6. a line refused for a passing reason (batch_lines.retry_in: a 429 or 503 with a
   Retry-After up to RETRY_MAX_WAIT_S, before the batch expires) stops the chunk from
   starting more lines and is not written: the next chunk is scheduled that long later.

Results are appended to partial files (0600) as lines finish; a cursor in Redis (input
byte offset, line number, and the partial files' sizes there) says where the next chunk
starts, and the lines written past the sizes it records are skipped as done. A rerun
(Celery redelivers the task of a worker that died) therefore runs no line twice; a lost
cursor only costs reading from the start again.

Cancel (`batch_cancel`) marks the batch cancelling under its row lock and, when no
chunk holds the tenant's lock for it, ends it `cancelled` at once: a batch whose chunk
died never stays `validating` or `cancelling`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from secrets import token_hex
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import F
from django.utils import timezone
from redis.exceptions import RedisError

from governance.privacy import Redactor, redactor_now
from sluice.db import async_db
from sluice.errors import ApiError, ServerError
from sluice.private_files import open_private
from sluice.redis import sync_redis
from streaming.batches import lines as batch_lines
from streaming.batches.files import TERMINAL, files_dir, store
from streaming.batches.identity import Revoked, resolve
from streaming.models import Batch, BatchStatus, StoredFile
from streaming.pipeline.gateway import Gateway
from tenants.principal import Principal

logger = logging.getLogger("sluice.batches")
CONCURRENCY = 8
LOCK_TTL_S = 30  # a chunk whose worker died frees its tenant this long after
WATCH_S = 0.5
BUSY_RETRY_S = 2.0  # the tenant's lock is held: come back about this long later
FAULT_RETRY_S = 5.0  # the database or Redis failed: come back this long later
_CURSOR_TTL_S = 26 * 3600  # past the 24 h window

# Delete the lock only if it is still ours; renew it only while it is.
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"  # noqa: E501
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"  # noqa: E501


@dataclass(frozen=True)
class Step:
    """What a chunk left: the batch's status, and when to run the next chunk (seconds
    from now), None when the batch ended or needs none."""

    status: str
    again_in: float | None = None


# -- the tenant's chunk lock and the cursor -------------------------------------------
def _lock_key(batch: Batch) -> str:
    return f"sluice:{{{batch.principal['tenant_slug']}}}:batch:chunk"


def _cursor_key(batch: Batch) -> str:
    return f"sluice:{{{batch.principal['tenant_slug']}}}:batch:{batch.pk}:cursor"


def chunk_running(batch: Batch) -> bool:
    """Whether a chunk of this batch holds its tenant's lock now."""
    holder = sync_redis().get(_lock_key(batch))
    text = holder.decode() if isinstance(holder, bytes) else str(holder or "")
    return text.split(":", 1)[0] == str(batch.pk)


@dataclass
class _Cursor:
    offset: int = 0  # input byte offset where the next chunk starts
    number: int = 1  # that line's number
    out_size: int = 0  # the partial files' sizes when the cursor moved there
    err_size: int = 0


def _cursor(batch: Batch) -> _Cursor:
    raw = sync_redis().get(_cursor_key(batch))
    text = raw.decode() if isinstance(raw, bytes) else str(raw or "")
    try:
        return _Cursor(*(int(x) for x in text.split(":")))
    except (TypeError, ValueError):
        return _Cursor()  # none yet, or lost: every written line is read as done


def _move(batch: Batch, cursor: _Cursor) -> None:
    sync_redis().set(_cursor_key(batch), f"{cursor.offset}:{cursor.number}:"
                     f"{cursor.out_size}:{cursor.err_size}", ex=_CURSOR_TTL_S)


# -- a chunk --------------------------------------------------------------------------
def run_chunk(batch_id: int) -> Step:
    """Run the batch's next chunk (see the module's doc). Idempotent."""
    batch = Batch.objects.select_related("input_file").filter(pk=batch_id).first()
    if batch is None or batch.status in TERMINAL:
        return Step(batch.status if batch else "missing")
    token = f"{batch.pk}:{token_hex(8)}"
    rds = sync_redis()
    try:
        if not rds.set(_lock_key(batch), token, nx=True, px=LOCK_TTL_S * 1000):
            return Step(batch.status, BUSY_RETRY_S * random.uniform(1.0, 1.5))  # noqa: S311
    except RedisError:
        return Step(batch.status, FAULT_RETRY_S)
    try:
        return _locked(batch, token)
    except (DatabaseError, RedisError):
        logger.warning("batch %s: chunk failed, trying again", batch.public_id, exc_info=True)
        return Step(batch.status, FAULT_RETRY_S)
    except SoftTimeLimitExceeded:
        return Step(batch.status, 0.0)  # what finished is written; the rest runs next
    except Exception:
        # A fault of ours must not leave the batch running for good.
        logger.exception("batch %s: chunk crashed; failing the batch", batch.public_id)
        finish(batch, BatchStatus.FAILED, errors=[
            {"code": "internal_error", "line": None,
             "message": "The batch could not be run."}])
        return Step(BatchStatus.FAILED)
    finally:
        with contextlib.suppress(RedisError):
            rds.eval(_RELEASE, 1, _lock_key(batch), token)


def _locked(batch: Batch, token: str) -> Step:
    with transaction.atomic():
        status = Batch.objects.select_for_update().filter(pk=batch.pk).values_list(
            "status", flat=True).first()
    if status is None or status in TERMINAL:
        return Step(status or "missing")
    if status == BatchStatus.CANCELLING:
        return Step(finish(batch, BatchStatus.CANCELLED))
    if timezone.now() >= batch.expires_at:
        return Step(finish(batch, BatchStatus.EXPIRED))
    try:
        principal = resolve(batch.principal)
    except Revoked as exc:
        return Step(_revoked(batch, str(exc)))
    work = files_dir(batch.tenant_id)
    parts = (work / f"{batch.public_id}.out.part", work / f"{batch.public_id}.err.part")
    clean = redactor_now(batch.tenant_id)
    if status == BatchStatus.VALIDATING:
        failed = _validate(batch, parts[1])
        if failed is not None:
            return Step(failed)
    return _chunk(batch, principal, token, parts, clean)


def _validate(batch: Batch, err_part: Path) -> str | None:
    """Check the file and write the unreadable lines' error lines; the batch's final
    status when it failed validation, else None (it is in progress)."""
    requests, unreadable, errors = batch_lines.validate(Path(batch.input_file.path),
                                                        batch.endpoint)
    if errors:
        Batch.objects.filter(pk=batch.pk).update(
            status=BatchStatus.FAILED, failed_at=timezone.now(),
            errors={"object": "list", "data": errors[:100]})
        return BatchStatus.FAILED
    done = batch_lines.done_marks(err_part)  # a rerun writes none twice
    with open_private(err_part, "a", encoding="utf-8") as f:
        for line in unreadable:
            if batch_lines.unreadable_mark(line.number) not in done:
                f.write(batch_lines.unreadable_line(line) + "\n")
    Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
        status=BatchStatus.IN_PROGRESS, in_progress_at=timezone.now(),
        total=requests + len(unreadable), failed=len(unreadable))
    return None


def _chunk(batch: Batch, principal: Principal, token: str, parts: tuple[Path, Path],
           clean: Redactor) -> Step:
    cursor = _cursor(batch)
    done = batch_lines.done_marks(parts[0], cursor.out_size) | batch_lines.done_marks(
        parts[1], cursor.err_size)
    window: list[batch_lines.Line] = []
    end, number, at_end = cursor.offset, cursor.number, True
    for line in batch_lines.read_lines(Path(batch.input_file.path), start=cursor.offset,
                                       first_number=cursor.number):
        if len(window) >= settings.SLUICE_BATCH_CHUNK_LINES:
            at_end = False
            break
        end, number = line.end, line.number + 1
        custom_id = line.item["custom_id"] if line.problem is None else None
        if custom_id is None or custom_id in done or clean(custom_id) in done:
            continue  # unreadable (written when validated) or done: either form counts
        window.append(line)
    run = _Run(batch, principal, token, parts, clean)
    asyncio.run(run.lines(window))
    Batch.objects.filter(pk=batch.pk).update(completed=F("completed") + run.completed,
                                             failed=F("failed") + run.failed)
    if run.revoked is not None:
        return Step(_revoked(batch, run.revoked))
    if run.cancelled:
        return Step(finish(batch, BatchStatus.CANCELLED))
    if run.wait_s is not None:
        # A little jitter, so that the lines refused together do not come back together.
        return Step(BatchStatus.IN_PROGRESS, run.wait_s * random.uniform(1.0, 1.25))  # noqa: S311
    if run.left:
        return Step(BatchStatus.IN_PROGRESS, 0.0)  # out of time: the rest runs next
    sizes = [p.stat().st_size if p.exists() else 0 for p in parts]
    _move(batch, _Cursor(end, number, *sizes))
    if at_end:
        return Step(finish(batch, BatchStatus.COMPLETED))
    return Step(BatchStatus.IN_PROGRESS, 0.0)


class _Run:
    """One chunk's lines on one event loop, with the watch that stops it."""

    def __init__(self, batch: Batch, principal: Principal, token: str,
                 parts: tuple[Path, Path], clean: Redactor) -> None:
        self.batch, self.principal, self.token = batch, principal, token
        self.parts, self.clean = parts, clean
        self.stop = asyncio.Event()
        self.completed = self.failed = 0
        self.wait_s: float | None = None  # the longest passing refusal's wait
        self.revoked: str | None = None
        self.cancelled = False
        self.left = False  # a line was not started: out of time or stopped
        self.deadline = time.monotonic() + settings.SLUICE_BATCH_CHUNK_S

    async def lines(self, window: list[batch_lines.Line]) -> None:
        gateway = Gateway()
        gate = asyncio.Semaphore(CONCURRENCY)
        watcher = asyncio.create_task(self._watch())
        try:
            await asyncio.gather(*(self._one(gateway, gate, line) for line in window))
        finally:
            self.stop.set()
            watcher.cancel()
            await gateway.close()

    async def _watch(self) -> None:
        key, ttl_ms = _lock_key(self.batch), str(LOCK_TTL_S * 1000)
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), WATCH_S)
            if self.stop.is_set():
                return
            try:
                await asyncio.to_thread(sync_redis().eval, _RENEW, 1, key, self.token, ttl_ms)
                status = await async_db(lambda: Batch.objects.filter(
                    pk=self.batch.pk).values_list("status", flat=True).first())()
                if status != BatchStatus.IN_PROGRESS:
                    self.cancelled = True
                    self.stop.set()
                    return
                await async_db(resolve)(self.batch.principal)
            except Revoked as exc:
                self.revoked = str(exc)
                self.stop.set()
                return
            except (DatabaseError, RedisError):
                # Looked at again next time; the next chunk checks all of it first.
                logger.warning("batch %s: watch failed", self.batch.public_id, exc_info=True)

    async def _one(self, gateway: Gateway, gate: asyncio.Semaphore,
                   line: batch_lines.Line) -> None:
        async with gate:
            if self.stop.is_set() or time.monotonic() > self.deadline:
                self.left = True
                return
            item = line.item
            try:
                status, body, rid = await batch_lines.call(gateway, self.principal,
                                                           self.batch.endpoint, item["body"])
            except ApiError as exc:
                wait_s = batch_lines.retry_in(exc)
                if wait_s is not None and timezone.now() + timedelta(
                        seconds=wait_s) < self.batch.expires_at:
                    self.wait_s = max(self.wait_s or 0.0, wait_s)
                    self.left = True
                    self.stop.set()
                    return
                status, body, rid = exc.status, exc.body(), ""
            except Exception:  # a line that breaks the pipeline fails alone
                logger.exception("batch %s: line %s failed", self.batch.public_id,
                                 line.number)
                fault = ServerError("This request could not be run.")
                status, body, rid = fault.status, fault.body(), ""
            self._write(batch_lines.answer_line(item["custom_id"], status, body, rid,
                                                self.clean), ok=status == 200)

    def _write(self, text: str, *, ok: bool) -> None:
        with open_private(self.parts[0] if ok else self.parts[1], "a", encoding="utf-8") as f:
            f.write(text + "\n")
        if ok:
            self.completed += 1
        else:
            self.failed += 1


# -- the end --------------------------------------------------------------------------
_STAMPS: dict[str, str] = {BatchStatus.COMPLETED: "completed_at",
                           BatchStatus.CANCELLED: "cancelled_at",
                           BatchStatus.FAILED: "failed_at"}


def _revoked(batch: Batch, why: str) -> str:
    return finish(batch, BatchStatus.FAILED, errors=[
        {"code": "credential_revoked", "line": None, "message": why}])


def finish(batch: Batch, final: str, *, errors: list[dict[str, Any]] | None = None) -> str:
    """End the batch: store its output and error files from the partial files and set
    `final` (`cancelled` instead of `completed` when it was cancelled meanwhile).
    Under the batch's row lock; a batch already ended keeps its end. Returns the status
    it has."""
    with transaction.atomic():
        current = Batch.objects.select_for_update().filter(pk=batch.pk).values_list(
            "status", flat=True).first()
        if current is None or current in TERMINAL:
            return current or "missing"
        if final == BatchStatus.COMPLETED and current == BatchStatus.CANCELLING:
            final = BatchStatus.CANCELLED
        now = timezone.now()
        Batch.objects.filter(pk=batch.pk).update(finalizing_at=now)
        outputs: dict[str, StoredFile | None] = {}
        counts = []
        work = files_dir(batch.tenant_id)
        for name, suffix in (("output", "out"), ("error", "err")):
            part = work / f"{batch.public_id}.{suffix}.part"
            content = part.read_bytes() if part.exists() else b""
            counts.append(content.count(b"\n"))
            outputs[name] = store(
                tenant_id=batch.tenant_id, filename=f"{batch.public_id}_{name}.jsonl",
                purpose="batch_output", content=content,
                created_by=batch.principal["subject"]) if content else None
        fields: dict[str, Any] = {"status": final, "output_file": outputs["output"],
                                  "error_file": outputs["error"], "completed": counts[0],
                                  "failed": counts[1]}
        stamp = _STAMPS.get(final)  # the row has no expired_at: finalizing_at says when
        if stamp is not None:
            fields[stamp] = now
        if errors is not None:
            fields["errors"] = {"object": "list", "data": errors}
        Batch.objects.filter(pk=batch.pk).update(**fields)
    # After the commit: a crash before here leaves partial files the retention sweeps.
    for suffix in ("out", "err"):
        (files_dir(batch.tenant_id) / f"{batch.public_id}.{suffix}.part").unlink(
            missing_ok=True)
    with contextlib.suppress(RedisError):
        sync_redis().delete(_cursor_key(batch))
    return final
