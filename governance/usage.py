"""Usage for billing: counted in Redis on the hot path, rolled up into rows off it.

Each settled call adds to `sluice:{<tenant>}:usage:<day>` (fields
`<model>|<key prefix>|r|p|c|n`: requests, prompt and completion tokens, cost in
nano-dollars, governance/pricing.py) and names its
tenant in `sluice:usage:tenants:<day>`; the gateway's recorder adds a settled call's
counts with its quota settlement, once per request id (governance/quota.py SETTLE_LUA),
and other counts (`count`) in flushes, each flush once (a retried one that Redis had
applied adds nothing). The
rollup (a Celery beat task, every SLUICE_USAGE_ROLLUP_S) copies the counters' totals
into UsageRecord rows; it writes absolute values, so running it twice, or from two
workers, is harmless. The counters live 40 days.
"""

from __future__ import annotations

from collections.abc import Collection
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


def applied_key(tenant: str, writer: str, what: str = "usage") -> str:
    """The last flush of `writer` (one gateway process's recorder) whose `what` (usage
    counts, "rl": token-bucket corrections) for `tenant` were applied: flushes are
    numbered in order, so a retried one adds nothing. (A deployment's marks, for its
    latencies and breaker outcomes, are in its own slot: recorder.py.)"""
    return f"sluice:{{{tenant}}}:{what}:applied:{writer}"


# The rest of a script runs once per flush of a writer. KEYS ends with the writer's mark
# (`applied_key`), ARGV with the mark's TTL and the flush's number; the prelude takes
# them off, so the rest sees its own KEYS and ARGV. A writer's flushes reach Redis in
# order (a failed one is retried ahead of later ones), so a number at or below the mark
# was applied: the script returns 0.
ONCE_PER_FLUSH_LUA = """
local flush, ttl, mark = table.remove(ARGV), table.remove(ARGV), table.remove(KEYS)
if tonumber(flush) <= tonumber(redis.call('GET', mark) or '-1') then return 0 end
redis.call('SET', mark, flush, 'EX', ttl)
"""
# Add one flush's counts for one tenant. KEYS: the usage key. ARGV: the counters' TTL,
# then field/increment pairs.
COUNT_LUA = ONCE_PER_FLUSH_LUA + """
for i = 2, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""
# How long a writer's mark outlives its last flush: longer than a failed flush is retried
# (recorder.RETRY_FOR_S). One small key per tenant and gateway process.
APPLIED_TTL_S = 300


def once_per_flush(keys: list[str], args: list[Any], *, mark: str,
                   flush: int) -> tuple[list[str], list[Any]]:
    """A script's keys and args with the mark ONCE_PER_FLUSH_LUA takes off them (`mark`:
    the writer's key for what the script writes, in the same slot as `keys`)."""
    return [*keys, mark], [*args, APPLIED_TTL_S, flush]


def count(batch: ScriptBatch, *, tenant: str, writer: str, flush: int,
          rows: dict[tuple[str, str], list[int]]) -> None:
    """Queue the adding of one flush's usage for a tenant on a ScriptBatch: `rows` maps
    (model, key prefix) to [requests, prompt tokens, completion tokens]. `writer` and
    `flush` (numbered in order per writer) identify the flush: the same one written
    twice (a retry after a reply was lost) counts once."""
    day = datetime.now(UTC).date().isoformat()
    args: list[Any] = [USAGE_TTL_S]
    for (model, key_prefix), (requests, prompt, completion) in rows.items():
        field = f"{model}|{key_prefix}|"
        args += [field + "r", requests, field + "p", prompt, field + "c", completion]
    batch.script(COUNT_LUA, *once_per_flush([usage_key(tenant, day)], args,
                                            mark=applied_key(tenant, writer), flush=flush))
    index(batch, [tenant])


def index(batch: ScriptBatch, tenants: Collection[str]) -> None:
    """Queue naming `tenants` in today's tenant index (the rollup reads those tenants'
    counters). The index is in no tenant's slot; adding to a set twice is harmless."""
    if tenants:
        day = datetime.now(UTC).date().isoformat()
        batch.pipe.sadd(usage_index_key(day), *tenants)
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
                              "cost_nanousd": t.get("n", 0),
                              "updated_at": timezone.now()})
                written += 1
    return written
