"""Celery tasks of the protocol edge: the Batch API's runner."""

from __future__ import annotations

from celery import shared_task


@shared_task(acks_late=True, max_retries=3, default_retry_delay=10)
def run_batch(batch_id: int) -> str:
    """Idempotent: a redelivered job resumes after the lines already written."""
    from streaming import batches

    return batches.run(batch_id)
