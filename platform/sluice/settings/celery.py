"""Celery: Redis broker; tasks are idempotent and acknowledged late."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from sluice.settings.env import env_bool, env_int
from sluice.settings.redis import CELERY_REDIS_URL

# A single Redis: Celery cannot use a cluster (SLUICE_CELERY_REDIS_URL beside one).
CELERY_BROKER_URL = CELERY_REDIS_URL
CELERY_RESULT_BACKEND = CELERY_REDIS_URL
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TIME_LIMIT = env_int("SLUICE_CELERY_TASK_TIME_LIMIT_S", 3600, minimum=1)
CELERY_TASK_ALWAYS_EAGER = env_bool("SLUICE_CELERY_EAGER", False)
# Two queues, so that batches never hold up exports and the periodic jobs: "batches"
# (streaming.tasks.run_batch, one chunk of a batch each) and "maintenance" (everything
# else). A worker started without -Q consumes both; `sluice run` gives each its own.
BATCH_QUEUE = "batches"
MAINTENANCE_QUEUE = "maintenance"
CELERY_TASK_DEFAULT_QUEUE = MAINTENANCE_QUEUE
CELERY_TASK_QUEUES: dict[str, dict[str, str]] = {BATCH_QUEUE: {}, MAINTENANCE_QUEUE: {}}
CELERY_TASK_ROUTES = {"streaming.tasks.run_batch": {"queue": BATCH_QUEUE}}
# A batch chunk: at most this many lines, and starts none after this many seconds (a
# line started then runs to its end, within SLUICE_REQUEST_TIMEOUT_S).
SLUICE_BATCH_CHUNK_LINES = env_int("SLUICE_BATCH_CHUNK_LINES", 50, minimum=1)
SLUICE_BATCH_CHUNK_S = env_int("SLUICE_BATCH_CHUNK_S", 60, minimum=1)
if SLUICE_BATCH_CHUNK_LINES > 10_000 or SLUICE_BATCH_CHUNK_S > 3600:
    raise ImproperlyConfigured("SLUICE_BATCH_CHUNK_LINES must be <= 10000 and "
                               "SLUICE_BATCH_CHUNK_S <= 3600.")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_RETRY_DELAY = 5
# Django's LOGGING (with its redaction filter) stays in charge of the worker's logs.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
_RETENTION_SWEEP_S = env_int("SLUICE_RETENTION_SWEEP_S", 3600, minimum=60)
CELERY_BEAT_SCHEDULE = {
    "usage-rollup": {"task": "governance.tasks.usage_rollup",
                     "schedule": float(env_int("SLUICE_USAGE_ROLLUP_S", 60, minimum=5))},
    # Spend history (governance/rollups.py): the last hours, recomputed.
    "spend-rollup": {"task": "governance.tasks.spend_rollup",
                     "schedule": float(env_int("SLUICE_SPEND_ROLLUP_S", 300, minimum=10))},
    "audit-retention": {"task": "governance.tasks.audit_purge", "schedule": 86_400.0},
    # Conversations, batches and batch files past their tenant's retention.
    "conversations-retention": {"task": "governance.tasks.conversations_retention",
                                "schedule": float(_RETENTION_SWEEP_S)},
    "files-retention": {"task": "streaming.tasks.files_retention",
                        "schedule": float(_RETENTION_SWEEP_S)},
}
