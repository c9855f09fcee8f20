"""The inference hot path (/v1)."""

from __future__ import annotations

from sluice.settings.env import env_int

SLUICE_REQUEST_TIMEOUT_S = env_int("SLUICE_REQUEST_TIMEOUT_S", 120, minimum=1)
SLUICE_MAX_INFERENCE_BODY_BYTES = env_int("SLUICE_MAX_INFERENCE_BODY_BYTES", 4 * 1024 * 1024,
                                          minimum=1024)
SLUICE_REGISTRY_CACHE_TTL_S = env_int("SLUICE_REGISTRY_CACHE_TTL_S", 5, minimum=0)
