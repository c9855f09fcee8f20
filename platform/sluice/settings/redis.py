"""Redis: queue, rate limits, breakers, Channels layer and Celery broker share one URL."""

from __future__ import annotations

from sluice.settings.env import env_int, env_str

REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS_SOCKET_TIMEOUT_S = env_int("SLUICE_REDIS_TIMEOUT_MS", 2000, minimum=1) / 1000
