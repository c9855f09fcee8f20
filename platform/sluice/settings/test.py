"""Test settings: only overrides. DATABASE_URL and REDIS_URL come from the test command."""

from __future__ import annotations

from sluice.settings.base import *  # noqa: F403

# Fast hashing in tests only: PBKDF2's 1M rounds would dominate the suite's run time.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
# Close connections after each unit of work, so that the test database can be dropped
# at the end even though live-server tests query it from worker threads.
DATABASES["default"]["CONN_MAX_AGE"] = 0  # noqa: F405
LOGGING["root"]["level"] = "WARNING"  # type: ignore[index]  # noqa: F405
