"""Governance: how long gateways cache policies; the usage rollup schedule."""

from __future__ import annotations

from sluice.settings.env import env_int

# A policy edit bumps an epoch that every gateway sees within a second; this TTL bounds
# staleness when Redis cannot carry that signal.
SLUICE_POLICY_CACHE_TTL_S = env_int("SLUICE_POLICY_CACHE_TTL_S", 5, minimum=0)
# How often Celery beat copies the Redis usage counters into UsageRecord rows.
SLUICE_USAGE_ROLLUP_S = env_int("SLUICE_USAGE_ROLLUP_S", 60, minimum=5)
