"""The Celery app (Redis broker). Tasks live in each app's tasks.py."""

from __future__ import annotations

import os

from celery import Celery
from celery.signals import worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sluice.settings.base")

app = Celery("sluice")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_init.connect
def _telemetry(**_: object) -> None:
    """Batch jobs run through the gateway pipeline: their spans and logs need ids."""
    from sluice.observability import telemetry

    telemetry.setup("sluice-celery")
