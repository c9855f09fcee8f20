"""Governance: how long gateways cache policies; usage rollup; audit retention and
exports; redaction."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from sluice.settings.env import env_bool, env_int, env_list, env_str

# A policy edit bumps an epoch that every gateway sees within a second; this TTL bounds
# staleness when Redis cannot carry that signal.
SLUICE_POLICY_CACHE_TTL_S = env_int("SLUICE_POLICY_CACHE_TTL_S", 5, minimum=0)
# How often Celery beat copies the Redis usage counters into UsageRecord rows.
SLUICE_USAGE_ROLLUP_S = env_int("SLUICE_USAGE_ROLLUP_S", 60, minimum=5)
# Audit events older than this are purged daily (the chains stay verifiable).
SLUICE_AUDIT_RETENTION_DAYS = env_int("SLUICE_AUDIT_RETENTION_DAYS", 365, minimum=1)
# Audit events waiting in Redis for the audit writer past which new calls are refused
# (503 `audit_unavailable`) rather than served unaudited: below the stream's hard bound
# (governance.audit.STREAM_MAXLEN, where the oldest events would be trimmed and lost).
# 0: never refuse (past the bound the oldest events are lost).
SLUICE_AUDIT_REFUSE_AT = env_int("SLUICE_AUDIT_REFUSE_AT", 900_000, minimum=0)
# Stored responses waiting in Redis for the responses writer past which a call that
# asks to store its response is refused (503 `store_unavailable`) rather than stored
# where the stream may trim it (streaming.apis.responses.copy.STREAM_MAXLEN). 0: never refuse.
SLUICE_RESPONSES_REFUSE_AT = env_int("SLUICE_RESPONSES_REFUSE_AT", 900_000, minimum=0)
# National phone formats recognised by the redaction engine (E.164 always is).
SLUICE_PHONE_REGIONS = env_list("SLUICE_PHONE_REGIONS", ["US", "GB"])
# The platform's data-protection defaults (docs/AUDIT.md, "Data protection"); a tenant
# admin may choose otherwise for their tenant (PATCH /api/v1/tenants/{id}/privacy).
# Redact what is stored beyond the call: conversation turns, batch output and error
# files, batch metadata (the model then sees placeholders in a conversation's history).
SLUICE_REDACT_STORED = env_bool("SLUICE_REDACT_STORED", True)
# Days that conversations, stored responses and batch files are kept.
SLUICE_RETENTION_DAYS = env_int("SLUICE_RETENTION_DAYS", 30, minimum=1)
if SLUICE_RETENTION_DAYS > 3650:  # tenants.models.MAX_RETENTION_DAYS
    raise ImproperlyConfigured("SLUICE_RETENTION_DAYS must be <= 3650")
# How often Celery beat deletes what is past its tenant's retention.
SLUICE_RETENTION_SWEEP_S = env_int("SLUICE_RETENTION_SWEEP_S", 3600, minimum=60)
# Guardrails (docs/GUARDRAILS.md): the characters of a streamed reply that post-call
# guards hold back before they leave the gateway (at least the longest text a guard
# must see whole: a masked or blocked string never leaves in part). A match still
# growing at the window's edge is held up to 8 windows, then masked as it stands.
SLUICE_GUARD_HOLDBACK_CHARS = env_int("SLUICE_GUARD_HOLDBACK_CHARS", 128, minimum=16)
# /v1/moderations: the classifier deployment a call that names none gets, and the
# probability from which a category is flagged.
SLUICE_MODERATION_MODEL = env_str("SLUICE_MODERATION_MODEL", "injection-guard")
SLUICE_MODERATION_THRESHOLD = min(env_int("SLUICE_MODERATION_THRESHOLD_PCT", 50,
                                          minimum=1), 100) / 100
