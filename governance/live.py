"""Live governance figures for the management API and the admin UI, read from Redis:
a quota's current use, a budget's spend, a breaker's state and window, the effective
adaptive rates."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from governance import breaker, pricing, quota, ratelimit, signals
from governance.models import BreakerPolicy, Budget, Quota, RateLimitPolicy, RateLimitScope
from inference import autoscaler
from inference.models import Deployment
from inference.queue import (
    batch_sizes_key,
    depth_key,
    live_heartbeats,
    oldest_age_ms,
    stream_key,
    streams_key,
    workers_key,
)
from sluice.redis import sync_redis


def quota_use(row: Quota | Budget, clock: float | None = None) -> quota.QuotaUse:
    """The quota's or budget's window now (or at epoch seconds `clock`: reservations that
    expire before it are dropped for good)."""
    redis = sync_redis()
    reply = redis.eval(quota.PEEK_LUA, 3, *quota.keys_for(row.tenant.slug, [row]),
                       *quota.peek_args([row], clock))
    return quota.QuotaUse.from_reply(reply[0])


def budget_use(row: Budget) -> dict[str, Any]:
    """What the budget's window has spent, what running calls hold, when it resets."""
    use = quota_use(row)
    return {"spent_usd": pricing.usd(use.tokens), "held_usd": pricing.usd(use.reserved_tokens),
            "resets_at": (datetime.fromtimestamp(use.resets_at, UTC)
                          if use.resets_at else None), "alerted_pct": use.alerted}


def breaker_state(row: BreakerPolicy) -> dict[str, Any]:
    redis = sync_redis()
    name = row.deployment.name
    snap = breaker.Snapshot.from_reply(redis.eval(breaker.PEEK_LUA, 4, *breaker.keys(name),
                                                  *breaker.peek_args(row)))
    live = list(live_heartbeats(redis.hgetall(workers_key(name))).values())
    return {
        "state": snap.state, "calls": snap.calls, "failures": snap.failures,
        "slow_calls": snap.slow, "opened_at": snap.opened_at, "reason": snap.reason or None,
        "times_opened": snap.times_opened, "opened_by": snap.opened_by or None,
        "tenants_refused": list(snap.tenants_open),
        "times_tenant_opened": snap.times_tenant_opened, "workers": len(live),
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


def scaling_states() -> dict[str, dict[str, Any]]:
    """The autoscaler's latest picture per deployment (desired, live, depth...)."""
    return autoscaler.state(sync_redis())


@dataclass(frozen=True)
class DeploymentState:
    """One enabled deployment as Redis sees it now (one round trip per deployment)."""

    name: str
    depth: int  # queued or running
    oldest_age_s: float
    live: dict[str, dict[str, Any]]  # worker id -> heartbeat
    batch_sizes: dict[int, int]  # batch size -> batches admitted (since the start)
    breaker: breaker.Snapshot


def deployment_states() -> list[DeploymentState]:
    """Every enabled deployment's queue, workers, batches and breaker: what /metrics and
    the dashboard show, the same whichever gateway is asked."""
    redis = sync_redis()
    rows = list(Deployment.objects.filter(enabled=True).order_by("name"))
    policies = {p.deployment_id: p for p in BreakerPolicy.objects.filter(deployment__in=rows)}
    out = []
    for dep in rows:
        name = dep.name
        suffixes = [s.decode() for s in redis.hkeys(streams_key(name))]
        pipe = redis.pipeline(transaction=False)
        pipe.get(depth_key(name))
        pipe.hgetall(workers_key(name))
        pipe.hgetall(batch_sizes_key(name))
        policy = policies.get(dep.pk) or breaker.default_policy(dep.pk)
        pipe.eval(breaker.PEEK_LUA, 4, *breaker.keys(name), *breaker.peek_args(policy))
        for suffix in suffixes:
            pipe.xrange(stream_key(name, suffix), count=1)
        depth, beats, sizes, peek, *firsts = pipe.execute()
        out.append(DeploymentState(
            name=name, depth=int(depth or 0), oldest_age_s=oldest_age_ms(firsts) / 1000,
            live=live_heartbeats(beats), batch_sizes={int(k): int(v) for k, v in sizes.items()},
            breaker=breaker.Snapshot.from_reply(peek)))
    return out


def dashboard(window_s: int = 10) -> dict[str, Any]:
    """What the live dashboard draws, per enabled deployment: QPS and latency (p50/p99)
    and time to first token (p50) over the last `window_s` seconds, queue depth and
    oldest age, batch-size counters, breaker state, workers (live, in rotation,
    desired) and the highest worker memory share."""
    redis = sync_redis()
    states = autoscaler.state(redis)
    out = []
    for dep in deployment_states():
        calls = signals.latency_stats_sync(redis, dep.name, window_s)
        ttft = signals.latency_stats_sync(redis, dep.name, window_s, metric="ttft")
        live = list(dep.live.values())
        out.append({
            "name": dep.name, "qps": round(calls.qps, 2),
            "p50_ms": _ms(calls.p50_ms), "p99_ms": _ms(calls.p99_ms),
            "ttft_p50_ms": _ms(ttft.p50_ms), "depth": dep.depth,
            "oldest_age_s": round(dep.oldest_age_s, 3),
            "batch_sum": sum(size * n for size, n in dep.batch_sizes.items()),
            "batch_count": sum(dep.batch_sizes.values()),
            "breaker": str(dep.breaker.state), "workers": len(live),
            "in_rotation": sum(1 for b in live if b.get("in_rotation", True)),
            "desired": states.get(dep.name, {}).get("desired"),
            "memory": max((round(b["mem_used"] / b["mem_total"], 4) for b in live
                           if b.get("mem_total")), default=None),
        })
    return {"at": time.time(), "deployments": out}


def _ms(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None
