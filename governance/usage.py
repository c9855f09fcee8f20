"""Usage for billing: counted in Redis on the hot path, rolled up into rows off it.

Each settled call adds to `sluice:{<tenant>}:usage:<day>` (fields
`<model>|<key prefix>|r|p|c`: requests, prompt and completion tokens) and names its
tenant in `sluice:usage:tenants:<day>`. The rollup (a Celery beat task, every
SLUICE_USAGE_ROLLUP_S) copies the counters' totals into UsageRecord rows; it writes
absolute values, so running it twice, or from two workers, is harmless. The counters
live 40 days.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.utils import timezone

from governance.models import UsageRecord
from sluice.redis import sync_redis
from tenants.models import Tenant

USAGE_TTL_S = 40 * 86_400


def usage_key(tenant: str, day: str) -> str:
    return f"sluice:{{{tenant}}}:usage:{day}"


def usage_index_key(day: str) -> str:
    return f"sluice:usage:tenants:{day}"


def count(pipe: Any, *, tenant: str, model: str, key_prefix: str, requests: int,
          prompt: int, completion: int) -> None:
    """Queue the commands that add calls' usage on a pipeline."""
    day = datetime.now(UTC).date().isoformat()
    key, field = usage_key(tenant, day), f"{model}|{key_prefix}|"
    pipe.hincrby(key, field + "r", requests)
    pipe.hincrby(key, field + "p", prompt)
    pipe.hincrby(key, field + "c", completion)
    pipe.expire(key, USAGE_TTL_S)
    pipe.sadd(usage_index_key(day), tenant)
    pipe.expire(usage_index_key(day), USAGE_TTL_S)


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
