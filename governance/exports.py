"""Audit exports: a Celery job writes the events an auditor selected to JSONL or CSV
under <state dir>/exports/, reporting progress on its AuditExport row. Reruns rewrite
the same file (idempotent); the file appears only when complete (written aside, then
renamed). CSV cells are neutralized against formula injection (`csv_cell`): a text cell
that a spreadsheet would run as a formula starts with a single quote."""

from __future__ import annotations

import asyncio
import csv
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import OperationalError
from django.http import FileResponse
from django.utils import timezone

from governance.models import AuditEvent, AuditExport, ExportStatus
from governance.selectors import filter_events
from sluice.errors import Conflict
from sluice.private_files import open_private, private_dirs

COLUMNS = ["chain", "seq", "at", "tenant_id", "actor", "role", "key_prefix", "action",
           "target", "model", "protocol", "status", "latency_ms", "prompt_tokens",
           "completion_tokens", "request_id", "trace_id", "request_excerpt",
           "response_excerpt", "detail", "hash", "prev_hash"]
_PROGRESS_EVERY = 1000


class Retryable(Exception):
    pass


def export_dir() -> Path:
    return private_dirs(Path(settings.STATE_DIR), "exports")  # 0700; exports are 0600


# OWASP's "CSV Injection": a cell starting with one of these is a formula (or, with tab
# and carriage return, becomes one once a spreadsheet trims it).
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: Any) -> Any:
    """A value as a CSV cell a spreadsheet shows as text: a string starting with
    = + - @ tab or carriage return gets a leading single quote; other values unchanged
    (prompts, models, targets and actors are caller input)."""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def _row(event: AuditEvent) -> dict[str, Any]:
    out = {name: getattr(event, name) for name in COLUMNS}
    out["at"] = event.at.isoformat()
    return out


def run(export_id: int) -> str:
    job = AuditExport.objects.filter(pk=export_id).first()
    if job is None or job.status == ExportStatus.DONE:
        return job.path if job else ""
    try:
        events = filter_events(AuditEvent.objects.all(), tenant_id=job.tenant_id,
                               **job.filters).order_by("chain", "seq")
        AuditExport.objects.filter(pk=job.pk).update(
            status=ExportStatus.RUNNING, total=events.count(), done=0)
        final = export_dir() / f"audit-{job.pk}.{job.format}"
        partial = final.with_suffix(final.suffix + ".part")
        done = 0
        with open_private(partial, "w", newline="", encoding="utf-8") as out:
            writer = csv.DictWriter(out, fieldnames=COLUMNS) if job.format == "csv" else None
            if writer is not None:
                writer.writeheader()
            for event in events.iterator(chunk_size=2000):
                row = _row(event)
                if writer is not None:
                    row["detail"] = json.dumps(row["detail"])
                    writer.writerow({k: csv_cell(v) for k, v in row.items()})
                else:
                    out.write(json.dumps(row, default=str) + "\n")
                done += 1
                if done % _PROGRESS_EVERY == 0:
                    AuditExport.objects.filter(pk=job.pk).update(done=done)
        partial.replace(final)
        AuditExport.objects.filter(pk=job.pk).update(
            status=ExportStatus.DONE, done=done, path=str(final), finished_at=timezone.now())
        return str(final)
    except OperationalError as exc:
        raise Retryable(str(exc)) from exc
    except Exception as exc:
        AuditExport.objects.filter(pk=job.pk).update(
            status=ExportStatus.FAILED, error=type(exc).__name__, finished_at=timezone.now())
        raise


class ChunkedFileResponse(FileResponse):
    """A file download that an ASGI server sends a chunk at a time. Django's own
    FileResponse, served by its ASGI handler, first reads the whole file into memory
    (its synchronous iterator consumed in one go, with a warning): an export of
    millions of events would be held whole for each download. Here each chunk is read
    in a thread as the previous one is sent; under WSGI it iterates as Django's does."""

    block_size = 64 * 1024

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = self.streaming_content  # the file, block_size at a time
        assert isinstance(chunks, Iterator)  # noqa: S101 - a file's reads are synchronous
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            yield chunk


def export_file(export: AuditExport) -> FileResponse:
    """A finished export as a download (409 while it is still running)."""
    if export.status != ExportStatus.DONE:
        raise Conflict(f"The export is {export.status}; download it when it is done.",
                       code="export_not_ready")
    content_type = "text/csv" if export.format == "csv" else "application/x-ndjson"
    return ChunkedFileResponse(Path(export.path).open("rb"), as_attachment=True,
                               filename=f"audit-{export.pk}.{export.format}",
                               content_type=content_type)
