"""Usage for billing: counted in Redis on the hot path, rolled up into rows off it.

Each settled call adds to `sluice:{<tenant>}:usage:<day>` (fields
`<model>|<key prefix>|r|p|c`: requests, prompt and completion tokens) and names its
tenant in `sluice:usage:tenants:<day>`; the gateway's recorder adds its calls' counts in
flushes, each flush once (a retried one that Redis had applied adds nothing). The
rollup (a Celery beat task, every SLUICE_USAGE_ROLLUP_S) copies the counters' totals
into UsageRecord rows; it writes absolute values, so running it twice, or from two
workers, is harmless. The counters live 40 days.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.utils import timezone

from governance.models import UsageRecord
from sluice.redis import ScriptBatch, sync_redis
from tenants.models import Tenant

USAGE_TTL_S = 40 * 86_400


def usage_key(tenant: str, day: str) -> str:
    return f"sluice:{{{tenant}}}:usage:{day}"


def usage_index_key(day: str) -> str:
    return f"sluice:usage:tenants:{day}"


def applied_key(tenant: str, flush: str) -> str:
    """Set once a flush's counts for `tenant` are added: a retried flush adds nothing."""
    return f"sluice:{{{tenant}}}:usage:flush:{flush}"


# Add one flush's counts for one tenant, once. KEYS: usage key, applied key.
# ARGV: TTL of the counters, TTL of the applied mark, then field/increment pairs.
COUNT_LUA = """
if not redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[2]) then return 0 end
for i = 3, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""
APPLIED_TTL_S = 3600  # far beyond how long a failed flush is retried


def count(batch: ScriptBatch, *, tenant: str, flush: str,
          rows: dict[tuple[str, str], list[int]]) -> None:
    """Queue the adding of one flush's usage for a tenant on a ScriptBatch: `rows` maps
    (model, key prefix) to [requests, prompt tokens, completion tokens]. `flush`
    identifies the flush: the same one written twice (a retry after a reply was lost)
    counts once."""
    day = datetime.now(UTC).date().isoformat()
    args: list[Any] = [USAGE_TTL_S, APPLIED_TTL_S]
    for (model, key_prefix), (requests, prompt, completion) in rows.items():
        field = f"{model}|{key_prefix}|"
        args += [field + "r", requests, field + "p", prompt, field + "c", completion]
    batch.script(COUNT_LUA, [usage_key(tenant, day), applied_key(tenant, flush)], args)
    # The day's tenant index is in no tenant's slot; adding to a set twice is harmless.
    batch.pipe.sadd(usage_index_key(day), tenant)
    batch.pipe.expire(usage_index_key(day), USAGE_TTL_S)


def rollup(days: list[date] | None = None) -> int:
    """Copy the counters of `days` (default: today and yesterday, UTC) into rows.
    Returns the number of rows written."""
    today = datetime.now(UTC).date()
    redis = sync_redis()
    written = 0
    for day in days or [today - timedelta(days=1), today]:
        label = day.isoformat()
        for raw_slug in redis.smembers(usage_index_key(label)):
            slug = raw_slug.decode()
            tenant = Tenant.objects.filter(slug=slug).first()
            if tenant is None:
                continue
            totals: dict[tuple[str, str], dict[str, int]] = {}
            for raw_field, value in redis.hgetall(usage_key(slug, label)).items():
                model, prefix, metric = raw_field.decode().rsplit("|", 2)
                totals.setdefault((model, prefix), {})[metric] = int(value)
            for (model, prefix), t in totals.items():
                UsageRecord.objects.update_or_create(
                    tenant=tenant, model=model, key_prefix=prefix, day=day,
                    defaults={"requests": t.get("r", 0), "prompt_tokens": t.get("p", 0),
                              "completion_tokens": t.get("c", 0),
                              "updated_at": timezone.now()})
                written += 1
    return written
