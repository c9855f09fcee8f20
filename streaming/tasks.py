"""Celery tasks of the protocol edge: the Batch API's runner and the retention of batch
files, batches and stored responses."""

from __future__ import annotations

from celery import shared_task


@shared_task(acks_late=True, max_retries=3, default_retry_delay=10)
def run_batch(batch_id: int) -> str:
    """Idempotent: a redelivered job resumes after the lines already written."""
    from streaming import batches

    return batches.run(batch_id)


@shared_task(acks_late=True, max_retries=3)
def files_retention() -> dict[str, int]:
    """Delete batches, batch files and stored responses past their tenant's retention
    (beat, every SLUICE_RETENTION_SWEEP_S). Idempotent: it deletes by age and state only."""
    from streaming import files, responses_store

    return {**files.retention_purge(), "responses": responses_store.responses_purge()}
