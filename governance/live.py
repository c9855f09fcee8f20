"""Live governance figures for the management API and the admin UI, read from Redis:
a quota's current use, a breaker's state and window, the effective adaptive rates."""

from __future__ import annotations

from typing import Any

from governance import breaker, quota, ratelimit, signals
from governance.models import BreakerPolicy, Quota, RateLimitPolicy, RateLimitScope
from inference.models import Deployment
from inference.queue import live_heartbeats, workers_key
from sluice.redis import sync_redis


def quota_use(row: Quota) -> quota.QuotaUse:
    redis = sync_redis()
    reply = redis.eval(quota.PEEK_LUA, 3, *quota.keys_for(row.tenant.slug, [row]),
                       *quota.peek_args([row]))
    return quota.QuotaUse.from_reply(reply[0])


def breaker_state(row: BreakerPolicy) -> dict[str, Any]:
    redis = sync_redis()
    name = row.deployment.name
    snap = breaker.Snapshot.from_reply(redis.eval(breaker.PEEK_LUA, 4, *breaker.keys(name),
                                                  *breaker.peek_args(row)))
    live = list(live_heartbeats(redis.hgetall(workers_key(name))).values())
    return {
        "state": snap.state, "calls": snap.calls, "failures": snap.failures,
        "slow_calls": snap.slow, "opened_at": snap.opened_at, "reason": snap.reason or None,
        "times_opened": snap.times_opened, "workers": len(live),
        "workers_in_rotation": sum(1 for b in live if b.get("in_rotation", True)),
        "memory": [round(b["mem_used"] / b["mem_total"], 4) for b in live
                   if b.get("mem_total")],
    }


def breaker_reset(row: BreakerPolicy) -> None:
    """Close the breaker now and forget its window (an operator's override)."""
    sync_redis().delete(*breaker.keys(row.deployment.name))


def effective_rates(policy: RateLimitPolicy) -> list[dict[str, Any]]:
    """Per deployment the policy may govern: the adaptive factor and the limits it gives."""
    if policy.scope == RateLimitScope.MODEL and policy.model:
        names = [policy.model]
    else:
        names = list(Deployment.objects.filter(enabled=True).values_list("name", flat=True))
    redis = sync_redis()
    out = []
    for name in names:
        stats = signals.latency_stats_sync(redis, name, policy.window_s)
        factor = ratelimit.adaptive_factor(policy, stats.qps, stats.p99_ms)
        out.append({
            "model": name, "factor": round(factor, 4), "qps": round(stats.qps, 3),
            "p99_ms": round(stats.p99_ms, 1) if stats.p99_ms is not None else None,
            "samples": stats.samples,
            "requests_per_minute": (round(policy.requests_per_minute * factor, 2)
                                    if policy.requests_per_minute else None),
            "tokens_per_minute": (round(policy.tokens_per_minute * factor, 2)
                                  if policy.tokens_per_minute else None),
        })
    return out
