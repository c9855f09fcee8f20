"""The cluster's state as Prometheus families, read from Redis (and the policy tables)
at scrape time by whichever process is scraped; the composition root adds the
collector to /metrics (platform/sluice/observability/metrics.py add_collector).

    sluice_queue_depth{deployment}, sluice_queue_oldest_age_seconds{deployment}
    sluice_workers{deployment}, sluice_workers_in_rotation{deployment}
    sluice_worker_device_memory_bytes{deployment,worker,kind}   kind: used | total
    sluice_batch_size{deployment}                     histogram of admitted batch sizes
    sluice_prefix_cache_blocks{deployment,worker,kind}   kind: used | capacity
    sluice_prefix_cache_{lookups,hits,hit_tokens,evictions}_total{deployment,worker}
    sluice_breaker_state{deployment}                  0 closed, 1 half-open, 2 open
    sluice_breaker_opens_total{deployment}
    sluice_quota_used{tenant,model,period,metric} and sluice_quota_limit{...}
    sluice_autoscaler_desired_replicas{deployment}, ..._running_replicas{deployment}
    sluice_cold_start_seconds{deployment}             worker start to first heartbeat
    sluice_autoscaler_events_total{deployment,kind}   kind: scale | restart | ready
    sluice_audit_backlog, sluice_responses_backlog (and their _oldest_age_seconds)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_BREAKER_VALUE = {"closed": 0, "half_open": 1, "open": 2}
_CLUSTER_TTL_S = 1.0


def batch_histogram(counts: dict[int, int]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative buckets and the sum, from exact counts per batch size."""
    buckets = []
    for bound in BATCH_BUCKETS:
        buckets.append((floatToGoString(bound),
                        float(sum(c for s, c in counts.items() if s <= bound))))
    total = sum(counts.values())
    buckets.append(("+Inf", float(total)))
    return buckets, float(sum(s * c for s, c in counts.items()))


class ClusterCollector(Collector):
    """Deployment, worker, breaker and quota state from Redis (and the policy tables),
    read at most once per second however often it is scraped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cached: tuple[float, list[Any]] = (0.0, [])

    def describe(self) -> Iterable[Any]:
        return []  # nothing to check at registration (that would read Redis)

    def collect(self) -> Iterator[Any]:
        with self._lock:
            at, families = self._cached
            if time.monotonic() - at > _CLUSTER_TTL_S:
                families = list(self._read())
                self._cached = (time.monotonic(), families)
        yield from families

    def _read(self) -> Iterator[Any]:
        from governance import quota
        from governance.live import deployment_states
        from governance.models import Quota
        from sluice.redis import sync_redis

        redis = sync_redis()
        depth = GaugeMetricFamily("sluice_queue_depth", "Requests queued or running.",
                                  labels=["deployment"])
        age = GaugeMetricFamily("sluice_queue_oldest_age_seconds", "Age of the oldest "
                                "queued request.", labels=["deployment"])
        workers = GaugeMetricFamily("sluice_workers", "Live workers (fresh heartbeat).",
                                    labels=["deployment"])
        rotation = GaugeMetricFamily("sluice_workers_in_rotation", "Live workers not held "
                                     "out by the memory guard.", labels=["deployment"])
        memory = GaugeMetricFamily("sluice_worker_device_memory_bytes", "Device memory of "
                                   "each worker.", labels=["deployment", "worker", "kind"])
        batches = HistogramMetricFamily("sluice_batch_size", "Requests admitted together "
                                        "into a batch.", labels=["deployment"])
        state = GaugeMetricFamily("sluice_breaker_state", "Circuit breaker: 0 closed, "
                                  "1 half-open, 2 open.", labels=["deployment"])
        opens = CounterMetricFamily("sluice_breaker_opens", "Times the breaker opened.",
                                    labels=["deployment"])
        states = deployment_states()
        for dep in states:
            name = dep.name
            depth.add_metric([name], float(dep.depth))
            age.add_metric([name], dep.oldest_age_s)
            workers.add_metric([name], float(len(dep.live)))
            rotation.add_metric([name], float(sum(1 for b in dep.live.values()
                                                  if b.get("in_rotation", True))))
            for wid, beat in sorted(dep.live.items()):
                if beat.get("mem_total"):
                    memory.add_metric([name, wid, "used"], float(beat["mem_used"]))
                    memory.add_metric([name, wid, "total"], float(beat["mem_total"]))
            buckets, total = batch_histogram(dep.batch_sizes)
            batches.add_metric([name], buckets, total)
            state.add_metric([name], float(_BREAKER_VALUE.get(dep.breaker.state, 0)))
            opens.add_metric([name], float(dep.breaker.times_opened))
        yield from (depth, age, workers, rotation, memory, batches, state, opens)
        yield from _prefix_families(states)
        yield from _autoscaler_families(redis, [d.name for d in states])
        yield from _writer_families(redis)

        used = GaugeMetricFamily("sluice_quota_used", "Use of each quota in its current "
                                 "period (reservations included).",
                                 labels=["tenant", "model", "period", "metric"])
        limit = GaugeMetricFamily("sluice_quota_limit", "Each quota's limit.",
                                  labels=["tenant", "model", "period", "metric"])
        rows = list(Quota.objects.select_related("tenant").order_by("id")[:10_000])
        pipe = redis.pipeline(transaction=False)
        for row in rows:
            pipe.eval(quota.PEEK_LUA, 3, *quota.keys_for(row.tenant.slug, [row]),
                      *quota.peek_args([row]))
        for row, reply in zip(rows, pipe.execute() if rows else [], strict=True):
            use = quota.QuotaUse.from_reply(reply[0])
            labels = [row.tenant.slug, row.model or "*", row.period]
            for metric, value, cap in (
                    ("requests", use.requests, row.max_requests),
                    ("tokens", use.tokens + use.reserved_tokens, row.max_tokens),
                    ("concurrent", use.open_reservations, row.max_concurrent)):
                if cap is not None:
                    used.add_metric([*labels, metric], float(value))
                    limit.add_metric([*labels, metric], float(cap))
        yield from (used, limit)


_PREFIX_COUNTERS = {
    "lookups": "Prompts looked up in the prefix cache.",
    "hits": "Prompts that found at least one cached block.",
    "hit_tokens": "Prompt tokens not prefilled thanks to the prefix cache.",
    "evictions": "Blocks evicted from the prefix cache.",
}


def _prefix_families(states: Iterable[Any]) -> Iterator[Any]:
    """Each worker's prefix cache (inference/runtimes/prefix_cache.py), as it last beat."""
    blocks = GaugeMetricFamily("sluice_prefix_cache_blocks", "Blocks in each worker's "
                               "prefix cache, and its capacity.",
                               labels=["deployment", "worker", "kind"])
    counters = {name: CounterMetricFamily(f"sluice_prefix_cache_{name}", text,
                                          labels=["deployment", "worker"])
                for name, text in _PREFIX_COUNTERS.items()}
    for dep in states:
        for wid, beat in sorted(dep.live.items()):
            if "prefix_cache_blocks" not in beat:
                continue
            blocks.add_metric([dep.name, wid, "used"], float(beat["prefix_cache_blocks"]))
            blocks.add_metric([dep.name, wid, "capacity"],
                              float(beat.get("prefix_cache_capacity_blocks", 0)))
            for name, family in counters.items():
                family.add_metric([dep.name, wid], float(beat.get(f"prefix_cache_{name}", 0)))
    yield blocks
    yield from counters.values()


_BACKLOG_HELP = {
    "audit": ("Audit events in Redis not yet written to the database.",
              "Age of the oldest audit event not yet written to the database."),
    "responses": ("Stored responses in Redis not yet written to the database.",
                  "Age of the oldest stored response not yet written to the database."),
}


def _writer_families(redis: Any) -> Iterator[Any]:
    """What waits in Redis for each writer process (sluice/streamwriter.py STREAMS): how
    many entries, and how old the oldest is. A backlog that grows means its writer is
    down or slow. At SLUICE_AUDIT_REFUSE_AT audit events the gateways refuse new calls
    (503 `audit_unavailable`) rather than serve them unaudited; at
    SLUICE_RESPONSES_REFUSE_AT stored responses, calls that ask to store (503
    `store_unavailable`): past a stream's bound (1,000,000) the oldest would be trimmed
    and lost."""
    from inference.queue import oldest_age_ms
    from sluice.streamwriter import STREAMS

    pipe = redis.pipeline(transaction=False)
    for stream in STREAMS.values():
        pipe.xlen(stream)
        pipe.xrange(stream, count=1)
    replies = pipe.execute()
    for i, name in enumerate(STREAMS):
        length, first = replies[2 * i], replies[2 * i + 1]
        count_help, age_help = _BACKLOG_HELP[name]
        backlog = GaugeMetricFamily(f"sluice_{name}_backlog", count_help)
        backlog.add_metric([], float(length))
        age = GaugeMetricFamily(f"sluice_{name}_backlog_oldest_age_seconds", age_help)
        age.add_metric([], oldest_age_ms([first]) / 1000)
        yield from (backlog, age)


def _autoscaler_families(redis: Any, names: list[str]) -> Iterator[Any]:
    from inference import autoscaler

    desired = GaugeMetricFamily("sluice_autoscaler_desired_replicas", "Workers the "
                                "autoscaler wants (KEDA scales Kubernetes workers to this).",
                                labels=["deployment"])
    running = GaugeMetricFamily("sluice_autoscaler_running_replicas", "Worker processes "
                                "the autoscaler runs (or live workers, without its local "
                                "driver).", labels=["deployment"])
    cold = HistogramMetricFamily("sluice_cold_start_seconds", "From starting a worker to "
                                 "its first heartbeat (model loaded).", labels=["deployment"])
    events = CounterMetricFamily("sluice_autoscaler_events", "Scaling decisions, restarts "
                                 "of dead workers, workers ready.", labels=["deployment", "kind"])
    states = autoscaler.state(redis)
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(autoscaler.cold_start_key(name))
    pipe.hgetall(autoscaler.counts_key())
    *colds, counts = pipe.execute()
    for name, raw in zip(names, colds, strict=True):
        if name in states:
            desired.add_metric([name], float(states[name]["desired"]))
            running.add_metric([name], float(states[name]["running"]))
        fields = {k.decode(): float(v) for k, v in raw.items()}
        if fields:
            buckets = [(floatToGoString(b), fields.get(str(b), 0.0))
                       for b in autoscaler.COLD_START_BUCKETS]
            cold.add_metric([name], [*buckets, ("+Inf", fields.get("count", 0.0))],
                            fields.get("sum", 0.0))
    for key, value in counts.items():
        name, _, kind = key.decode().partition("|")
        events.add_metric([name, kind], float(value))
    yield from (desired, running, cold, events)
