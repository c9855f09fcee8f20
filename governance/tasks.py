"""Celery tasks of governance. Idempotent: each may run twice without harm."""

from __future__ import annotations

from celery import shared_task

from governance import usage


@shared_task(acks_late=True, max_retries=3)
def usage_rollup() -> int:
    return usage.rollup()
