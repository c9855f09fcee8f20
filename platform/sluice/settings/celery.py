"""Celery: Redis broker; tasks are idempotent and acknowledged late."""

from __future__ import annotations

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
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_RETRY_DELAY = 5
# Django's LOGGING (with its redaction filter) stays in charge of the worker's logs.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
_RETENTION_SWEEP_S = env_int("SLUICE_RETENTION_SWEEP_S", 3600, minimum=60)
CELERY_BEAT_SCHEDULE = {
    "usage-rollup": {"task": "governance.tasks.usage_rollup",
                     "schedule": float(env_int("SLUICE_USAGE_ROLLUP_S", 60, minimum=5))},
    "audit-retention": {"task": "governance.tasks.audit_purge", "schedule": 86_400.0},
    # Conversations, batches and batch files past their tenant's retention.
    "conversations-retention": {"task": "governance.tasks.conversations_retention",
                                "schedule": float(_RETENTION_SWEEP_S)},
    "files-retention": {"task": "streaming.tasks.files_retention",
                        "schedule": float(_RETENTION_SWEEP_S)},
}
