"""The OpenAI Files API's storage, and the retention of batch files and batches.

Bytes live under <state dir>/files/<tenant id>/<public id>: directories 0700, files
0600 (sluice.private_files). An uploaded input file is kept as the tenant sent it (it
is their own data, and a batch must run on exactly that); what Sluice writes (batch
output and error files) is redacted per the tenant's policy before it is written
(streaming/batches/services.py), and file names are stored redacted too.

Every file expires `retention_days` (the tenant's, else SLUICE_RETENTION_DAYS) after
it was created: from then on it is NotFound to readers, and the retention task
(`retention_purge`, Celery beat) deletes its bytes and row, with the batches that are
finished and past retention themselves or whose input file is. The input file of a
batch still running is kept until that batch ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from datetime import datetime, timedelta
from pathlib import Path
from secrets import token_hex

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from governance.privacy import redactor_now
from sluice.errors import BadRequest, Conflict, NotFound, PayloadTooLarge
from sluice.private_files import open_private, private_dirs
from streaming.models import Batch, BatchStatus, StoredFile
from tenants.principal import Principal
from tenants.privacy import effective, policy_of, retention_groups
from tenants.roles import Action
from tenants.selectors import require

logger = logging.getLogger("sluice.files")
PURPOSES = ("batch",)
TERMINAL = (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.CANCELLED,
            BatchStatus.EXPIRED)
# A file on disk with no row is swept only this long after it was written (a row is
# created just after its bytes are).
_ORPHAN_AGE_S = 3600


def files_dir(tenant_id: int) -> Path:
    return private_dirs(Path(settings.STATE_DIR), "files", str(tenant_id))


def store(*, tenant_id: int, filename: str, purpose: str, content: bytes | Iterable[bytes],
          created_by: str, limit: int | None = None) -> StoredFile:
    """Write `content` (as given: callers redact what must be), chunk by chunk, and its
    row. Past `limit` bytes the partial file is removed and PayloadTooLarge raised: a
    stream is never held whole in memory."""
    public_id = f"file-{token_hex(12)}"
    path = files_dir(tenant_id) / public_id
    size = 0
    try:
        with open_private(path, "wb") as out:
            for chunk in (content,) if isinstance(content, bytes) else content:
                size += len(chunk)
                if limit is not None and size > limit:
                    raise PayloadTooLarge(f"Files are limited to {limit} bytes.")
                out.write(chunk)
        return StoredFile.objects.create(tenant_id=tenant_id, public_id=public_id,
                                         filename=redactor_now(tenant_id)(filename)[:255],
                                         purpose=purpose, bytes=size, path=str(path),
                                         created_by=created_by)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def expires_at(row: StoredFile) -> datetime:
    return row.created_at + timedelta(days=effective(row.tenant).retention_days)


def file_create(*, actor: Principal, filename: str, purpose: str,
                content: bytes | Iterable[bytes]) -> StoredFile:
    """Store an upload: `content` its bytes, or its chunks as they are read (an upload's
    `chunks()`), written as they come within SLUICE_MAX_FILE_BYTES."""
    require(actor, Action.MODEL_USE)
    if purpose not in PURPOSES:
        raise BadRequest(f"purpose must be one of {', '.join(PURPOSES)}.", param="purpose")
    return store(tenant_id=actor.tenant_id, filename=filename, purpose=purpose,
                 content=content, created_by=actor.subject,
                 limit=settings.SLUICE_MAX_FILE_BYTES)


def file_list(*, actor: Principal) -> QuerySet[StoredFile]:
    """The files the caller may read within their retention, newest first: a tenant
    admin (who manages every conversation of the tenant) reads every file of the
    tenant, anyone else only their own uploads and their own batches' outputs, as with
    conversations; another member's file is NotFound, like a missing one."""
    require(actor, Action.MODEL_USE)
    cutoff = policy_of(actor.tenant_id).cutoff()
    found = StoredFile.objects.filter(tenant_id=actor.tenant_id, created_at__gte=cutoff)
    if not actor.can(Action.CONVERSATION_MANAGE_ALL):
        found = found.filter(created_by=actor.subject)
    return found.select_related("tenant").order_by("-id")


def file_get(*, actor: Principal, file_id: str) -> StoredFile:
    row = file_list(actor=actor).filter(public_id=file_id).first()
    if row is None:
        raise NotFound(f"No such file: '{file_id[:64]}'.", param="file_id")
    return row


def file_content(*, actor: Principal, file_id: str) -> bytes:
    row = file_get(actor=actor, file_id=file_id)
    try:
        return Path(row.path).read_bytes()
    except FileNotFoundError:  # deleted while a batch still names it as its input
        raise NotFound(f"No such file: '{file_id[:64]}'.", param="file_id") from None


def file_delete(*, actor: Principal, file_id: str) -> StoredFile:
    row = file_get(actor=actor, file_id=file_id)
    if Batch.objects.filter(input_file=row).exclude(status__in=TERMINAL).exists():
        raise Conflict("The file is the input of a running batch.", param="file_id")
    Path(row.path).unlink(missing_ok=True)
    with transaction.atomic():
        Batch.objects.filter(output_file=row).update(output_file=None)
        Batch.objects.filter(error_file=row).update(error_file=None)
        if not Batch.objects.filter(input_file=row).exists():
            row.delete()
    return row


# -- retention ------------------------------------------------------------------------
def retention_purge(now: datetime | None = None) -> dict[str, int]:
    """Delete finished batches and files past their tenant's retention (see the
    module's doc), then partial files of batches that no longer run and files with no
    row. Idempotent: it deletes by age and state only."""
    now = now or timezone.now()
    paths: list[str] = []
    counts = {"batches": 0, "files": 0, "stray": 0}
    for group in retention_groups(now):
        with transaction.atomic():
            old = Batch.objects.filter(group.tenants(), status__in=TERMINAL).filter(
                Q(created_at__lt=group.cutoff) | Q(input_file__created_at__lt=group.cutoff))
            produced = [pk for pair in old.values_list("output_file_id", "error_file_id")
                        for pk in pair if pk is not None]
            counts["batches"] += old.delete()[1].get("streaming.Batch", 0)
            doomed = StoredFile.objects.filter(group.tenants()).filter(
                Q(created_at__lt=group.cutoff) | Q(pk__in=produced)).exclude(
                pk__in=Batch.objects.values("input_file_id"))
            paths += doomed.values_list("path", flat=True)
            counts["files"] += doomed.delete()[1].get("streaming.StoredFile", 0)
    for path in paths:  # after the rows: a crash here leaves strays, swept below
        Path(path).unlink(missing_ok=True)
    counts["stray"] = _sweep(time.time() - _ORPHAN_AGE_S)
    return counts


def _sweep(written_before: float) -> int:
    """Unlink partial files of batches that are finished or gone, and files that no
    row names (written before `written_before`)."""
    root = Path(settings.STATE_DIR) / "files"
    if not root.is_dir():
        return 0
    running = set(Batch.objects.exclude(status__in=TERMINAL).values_list("public_id",
                                                                         flat=True))
    swept = 0
    for folder in root.iterdir():
        named = set(StoredFile.objects.filter(path__startswith=f"{folder}/").values_list(
            "path", flat=True))
        for path in folder.iterdir() if folder.is_dir() else ():
            if path.name.endswith(".part"):
                stray = path.name.split(".", 1)[0] not in running
            else:
                stray = str(path) not in named and path.stat().st_mtime < written_before
            if stray:
                path.unlink(missing_ok=True)
                swept += 1
    return swept
