"""The inference hot path (/v1)."""

from __future__ import annotations

import os

from django.core.exceptions import ImproperlyConfigured

from sluice.settings.env import env_bool, env_int

SLUICE_REQUEST_TIMEOUT_S = env_int("SLUICE_REQUEST_TIMEOUT_S", 120, minimum=1)
SLUICE_MAX_INFERENCE_BODY_BYTES = env_int("SLUICE_MAX_INFERENCE_BODY_BYTES", 4 * 1024 * 1024,
                                          minimum=1024)
# A dropped SSE stream keeps generating this long, so a reconnect with Last-Event-ID can
# pick it up; after that it is cancelled (and billed only what was produced).
SLUICE_STREAM_RESUME_GRACE_S = float(env_int("SLUICE_STREAM_RESUME_GRACE_MS", 10_000,
                                             minimum=0)) / 1000
# A comment line on an SSE stream silent this long keeps proxies from closing it.
SLUICE_SSE_HEARTBEAT_S = env_int("SLUICE_SSE_HEARTBEAT_MS", 15_000, minimum=10) / 1000
SLUICE_REGISTRY_CACHE_TTL_S = env_int("SLUICE_REGISTRY_CACHE_TTL_S", 5, minimum=0)
# Files API uploads (Batch API input); Django's own upload limit follows it.
SLUICE_MAX_FILE_BYTES = env_int("SLUICE_MAX_FILE_BYTES", 100 * 1024 * 1024, minimum=1024)
# Upstream URLs on loopback or private networks (where vLLM usually runs) are refused
# unless the operator allows them (inference/upstream/urls.py: the SSRF guard).
SLUICE_UPSTREAM_ALLOW_PRIVATE = env_bool("SLUICE_UPSTREAM_ALLOW_PRIVATE", False)


def _share(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        value = default if raw is None else float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {raw!r}") from None
    if not 0.0 < value <= 1.0:
        raise ImproperlyConfigured(f"{name} must be in (0, 1], got {value}")
    return value


# While other tenants wait, one tenant runs at most this share of a deployment's batch
# (inference/engine/scheduler.py); alone it may use all of it. A deployment's spec may override.
SLUICE_TENANT_RUNNING_SHARE = _share("SLUICE_TENANT_RUNNING_SHARE", 0.5)

# Callers' schemas are compiled in child processes (inference/structured/grammar_check.py): this
# many per gateway process, each check within this budget and address-space headroom
# (over: 400 `schema_too_complex`, the child replaced).
SLUICE_GRAMMAR_CHECK_PROCESSES = env_int("SLUICE_GRAMMAR_CHECK_PROCESSES", 2, minimum=1)
SLUICE_GRAMMAR_CHECK_BUDGET_S = env_int("SLUICE_GRAMMAR_CHECK_BUDGET_MS", 3000,
                                        minimum=50) / 1000
SLUICE_GRAMMAR_CHECK_MEMORY_MB = env_int("SLUICE_GRAMMAR_CHECK_MEMORY_MB", 512, minimum=64)
