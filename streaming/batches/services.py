"""The OpenAI Batch API: services and selectors (files: streaming/batches/files.py).

A batch is created `validating` with its creator's principal frozen on the row, and
runs as a chain of Celery chunk tasks (streaming/batches/runner.py): each chunk resolves
that identity again (a revoked one ends the batch `failed` with `credential_revoked`),
sends its lines through the same gateway pipeline as a live call (RBAC, model access,
rate limits, quotas, breakers, audit with protocol "batch"), and a refused chunk is
scheduled again later instead of waiting in its task. Reading and sending a line:
streaming/batches/lines.py.

Cancelling marks the batch `cancelling`; the running chunk (if any) notices within a
second and ends it `cancelled`, keeping what finished; with no chunk running, the cancel
ends it itself.

What a batch stores is redacted per the tenant's policy (governance/privacy.py): its
metadata when created, every output and error line (string values; custom_id too)
before it is written. Partial and final files are 0600.
"""

from __future__ import annotations

from datetime import timedelta
from secrets import token_hex

from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from governance.privacy import redact_json, redactor_now
from sluice.errors import BadRequest, Conflict, NotFound
from streaming.batches import runner as batch_runner
from streaming.batches.files import TERMINAL, file_get
from streaming.batches.identity import frozen
from streaming.batches.lines import ENDPOINTS, retry_in
from streaming.batches.lines import call as _call
from streaming.models import Batch, BatchStatus
from tenants.principal import Principal
from tenants.privacy import policy_of
from tenants.roles import Action
from tenants.selectors import require

# What callers of this module use of the lines' module (tests drive a line with _call).
__all__ = ["ENDPOINTS", "_call", "batch_cancel", "batch_create", "batch_get", "batch_list",
           "retry_in"]


@transaction.atomic
def batch_create(*, actor: Principal, input_file_id: str, endpoint: str,
                 completion_window: str, metadata: dict[str, str] | None) -> Batch:
    require(actor, Action.MODEL_USE)
    if endpoint not in ENDPOINTS:
        raise BadRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}.", param="endpoint")
    if completion_window != "24h":
        raise BadRequest("completion_window must be '24h'.", param="completion_window")
    source = file_get(actor=actor, file_id=input_file_id)
    if source.purpose != "batch":
        raise BadRequest("The input file's purpose must be 'batch'.", param="input_file_id")
    batch = Batch.objects.create(
        tenant_id=actor.tenant_id, public_id=f"batch_{token_hex(12)}", endpoint=endpoint,
        input_file=source, principal=frozen(actor),
        metadata=redact_json(metadata, redactor_now(actor.tenant_id), keys=True),
        expires_at=timezone.now() + timedelta(hours=24))
    from sluice.auditlog import admin_action
    from streaming.tasks import run_batch

    admin_action(actor=actor, action="batch.create", target=batch.public_id,
                 detail={"endpoint": endpoint})
    transaction.on_commit(lambda: run_batch.delay(batch.pk))
    return batch


def batch_list(*, actor: Principal) -> QuerySet[Batch]:
    """The batches the caller may read (a tenant admin: the tenant's; anyone else: their
    own, as files), less the finished ones past the retention (or whose input file is:
    the retention task deletes those with it)."""
    require(actor, Action.MODEL_USE)
    cutoff = policy_of(actor.tenant_id).cutoff()
    found = Batch.objects.filter(tenant_id=actor.tenant_id)
    if not actor.can(Action.CONVERSATION_MANAGE_ALL):
        found = found.filter(principal__subject=actor.subject)
    return found.exclude(
        Q(created_at__lt=cutoff) | Q(input_file__created_at__lt=cutoff),
        status__in=TERMINAL).select_related(
        "input_file", "output_file", "error_file").order_by("-id")


def batch_get(*, actor: Principal, batch_id: str) -> Batch:
    row = batch_list(actor=actor).filter(public_id=batch_id).first()
    if row is None:
        raise NotFound(f"No such batch: '{batch_id[:64]}'.", param="batch_id")
    return row


@transaction.atomic
def batch_cancel(*, actor: Principal, batch_id: str) -> Batch:
    """Mark the batch cancelling; with no chunk of it running (none started yet, or its
    worker died), end it `cancelled` now. Conflict once it has ended otherwise."""
    batch = batch_get(actor=actor, batch_id=batch_id)
    # Under the row lock: a chunk that starts after this reads the new status.
    status = Batch.objects.select_for_update().filter(pk=batch.pk).values_list(
        "status", flat=True).first()
    if status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
        Batch.objects.filter(pk=batch.pk).update(status=BatchStatus.CANCELLING,
                                                 cancelling_at=timezone.now())
    elif status != BatchStatus.CANCELLING:
        raise Conflict(f"The batch is {status}; it cannot be cancelled.")
    if not batch_runner.chunk_running(batch):
        batch_runner.finish(batch, BatchStatus.CANCELLED)
    batch.refresh_from_db()
    return batch
