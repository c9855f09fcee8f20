"""Test settings: only overrides. DATABASE_URL and REDIS_URL come from the test command."""

from __future__ import annotations

from sluice.settings.base import *  # noqa: F403
from sluice.settings.env import env_int

# Fast hashing in tests only: PBKDF2's 1M rounds would dominate the suite's run time.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
# Close connections after each unit of work, so that the test database can be dropped
# at the end even though live-server tests query it from worker threads.
DATABASES["default"]["CONN_MAX_AGE"] = 0  # noqa: F405
LOGGING["root"]["level"] = "WARNING"  # type: ignore[index]  # noqa: F405
# The guessing throttle's thresholds, out of reach of a whole suite signing in from one
# loopback address; the throttle's own tests set theirs (settings, or the environment).
SLUICE_AUTH_ACCOUNT_FAILURES = env_int("SLUICE_AUTH_ACCOUNT_FAILURES", 1_000_000, minimum=1)
SLUICE_AUTH_SOURCE_FAILURES = env_int("SLUICE_AUTH_SOURCE_FAILURES", 1_000_000, minimum=1)
SLUICE_AUTH_ACCOUNT_SOURCES = env_int("SLUICE_AUTH_ACCOUNT_SOURCES", 1_000_000, minimum=1)
