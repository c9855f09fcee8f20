"""Telemetry: log format and access-log sampling, the /metrics guard. Tracing itself is
configured by the OpenTelemetry variables and SLUICE_TRACING (see
sluice/observability/telemetry.py)."""

from __future__ import annotations

from sluice.settings.env import env_int, env_list, env_str

# "json" (one object per line, with trace and request ids) or "text" for a terminal.
SLUICE_LOG_FORMAT = env_str("SLUICE_LOG_FORMAT", "json")
# Access lines kept per second per process for ordinary requests; errors, slow requests
# and critical routes (sign-in and the management API: low volume, high value) always are.
SLUICE_LOG_SAMPLE_PER_S = env_int("SLUICE_LOG_SAMPLE_PER_S", 20, minimum=0)
SLUICE_LOG_SLOW_MS = env_int("SLUICE_LOG_SLOW_MS", 2000, minimum=1)
SLUICE_LOG_CRITICAL_ROUTES = env_list("SLUICE_LOG_CRITICAL_ROUTES",
                                      ["/v1/auth/", "/api/v1/"])
# A bearer token Prometheus presents at /metrics; without one only loopback may scrape.
SLUICE_METRICS_TOKEN = env_str("SLUICE_METRICS_TOKEN", "")
