"""Celery tasks of the protocol edge: the Batch API's chunks (queue "batches") and the
retention of batch files, batches and stored responses (queue "maintenance")."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

# A chunk starts lines for SLUICE_BATCH_CHUNK_S, and the last one started may run
# SLUICE_REQUEST_TIMEOUT_S more; past that the task is stopped (the prefork pool
# enforces these: the rest of the batch runs in the next chunk).
_CHUNK_SOFT_LIMIT_S = settings.SLUICE_BATCH_CHUNK_S + settings.SLUICE_REQUEST_TIMEOUT_S + 30


@shared_task(acks_late=True, soft_time_limit=_CHUNK_SOFT_LIMIT_S,
             time_limit=_CHUNK_SOFT_LIMIT_S + 30)
def run_batch(batch_id: int) -> str:
    """Run one chunk of the batch and enqueue the next one with the countdown the
    runner asks for (never waiting in here: streaming/batches/runner.py). Idempotent: a
    redelivered chunk skips the lines already written."""
    from streaming.batches import runner as batch_runner

    step = batch_runner.run_chunk(batch_id)
    if step.again_in is not None:
        run_batch.apply_async((batch_id,), countdown=step.again_in)
    return step.status


@shared_task(acks_late=True, max_retries=3)
def files_retention() -> dict[str, int]:
    """Delete batches, batch files and stored responses past their tenant's retention
    (beat, every SLUICE_RETENTION_SWEEP_S). Idempotent: it deletes by age and state only."""
    from streaming.apis.responses import store as responses_store
    from streaming.batches import files

    return {**files.retention_purge(), "responses": responses_store.responses_purge()}
