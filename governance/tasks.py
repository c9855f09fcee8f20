"""Celery tasks of governance. Idempotent: each may run twice without harm."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from governance import alerts, usage


@shared_task(acks_late=True, max_retries=3)
def usage_rollup() -> int:
    return usage.rollup()


@shared_task(acks_late=True, max_retries=3)
def spend_rollup() -> int:
    """The last hours' audited calls into the hourly and daily spend rows (idempotent:
    whole periods are recomputed)."""
    from governance import rollups

    return rollups.roll()


@shared_task(acks_late=True, max_retries=3)
def audit_purge() -> int:
    """Delete audit events past the retention period (chains stay verifiable)."""
    from datetime import timedelta

    from django.conf import settings
    from django.utils import timezone

    from governance import audit

    cutoff = timezone.now() - timedelta(days=settings.SLUICE_AUDIT_RETENTION_DAYS)
    return audit.purge(cutoff)


@shared_task(acks_late=True, max_retries=3)
def conversations_retention() -> dict[str, int]:
    """Delete conversation messages and conversations past their tenant's retention
    (beat, every SLUICE_RETENTION_SWEEP_S). Idempotent: it deletes by age only."""
    from tenants.privacy import conversations_purge

    return conversations_purge()


@shared_task(bind=True, acks_late=True, max_retries=3, default_retry_delay=5)
def audit_export(self: Any, export_id: int) -> str:
    """Write an export's events to a file; idempotent (a rerun rewrites the file)."""
    from governance import exports

    try:
        return exports.run(export_id)
    except exports.Retryable as exc:
        raise self.retry(exc=exc) from exc


@shared_task(bind=True, acks_late=True, max_retries=alerts.MAX_ATTEMPTS)
def budget_alert_webhook(self: Any, source: str) -> str:
    """Deliver a stored budget alert to its tenant's webhook; retried with backoff (5 s,
    doubling, at most 10 minutes apart). Receivers drop a repeat by its event id."""
    try:
        return alerts.deliver(source)
    except alerts.DeliveryFailed as exc:
        raise self.retry(exc=exc, countdown=min(600, 5 * 2 ** self.request.retries)) from exc
