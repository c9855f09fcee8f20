"""What gateways measure about a deployment, for the adaptive rate limits.

Finished calls add their latencies (summed per gateway, see recorder.py) to a
log-bucketed histogram (10% wide buckets from 1 ms) in a Redis hash per five-second slot,
in the deployment's slot:
`sluice:q:{<dep>}:lat:<slot>` field b<bucket> -> count. Reading a window merges its
complete slots: QPS is the calls per second and P99 the upper edge of the bucket that
holds the 99th percentile (so it errs high by at most 10%). Slots expire after an hour.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from inference.queue import deployment_key

SLOT_S = 5
_GROWTH = 1.1
_BUCKETS = 200  # 1.1 ** 199 ms is over five hours
_KEEP_S = 3600 + 2 * SLOT_S


def bucket_of(ms: float) -> int:
    if ms <= 1:
        return 0
    return min(_BUCKETS - 1, math.ceil(math.log(ms) / math.log(_GROWTH)))


def upper_ms(bucket: int) -> float:
    return float(_GROWTH ** bucket)


def latency_key(deployment: str, slot: int, metric: str = "lat") -> str:
    """`metric`: "lat" (whole calls: the adaptive limits) or "ttft" (time to first
    token: the dashboard)."""
    return deployment_key(deployment, f"{metric}:{slot}")


# Add a histogram of calls' latencies. KEYS: the slot's key. ARGV: its TTL, then
# field/count pairs. (The recorder prepends usage.ONCE_PER_FLUSH_LUA.)
ADD_LUA = """
for i = 2, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""


def latencies_call(deployment: str, histogram: dict[int, int],
                   metric: str = "lat") -> tuple[list[str], list[Any]]:
    """ADD_LUA's keys and args for a histogram of calls' latencies, in the current slot."""
    args: list[Any] = [_KEEP_S]
    for bucket, count in histogram.items():
        args += [f"b{bucket}", count]
    return [latency_key(deployment, int(time.time()) // SLOT_S, metric)], args


@dataclass(frozen=True)
class LatencyStats:
    qps: float
    p99_ms: float | None  # None without samples
    samples: int
    p50_ms: float | None = None


def percentile(histogram: dict[int, int], fraction: float) -> float | None:
    total = sum(histogram.values())
    if total == 0:
        return None
    seen, wanted = 0, fraction * total
    for bucket in sorted(histogram):
        seen += histogram[bucket]
        if seen >= wanted:
            return upper_ms(bucket)
    return upper_ms(max(histogram))


def _window(redis: Any, deployment: str, window_s: int,
            metric: str = "lat") -> tuple[Any, int]:
    """A pipeline reading the complete five-second slots of the last `window_s` seconds."""
    slots = max(1, math.ceil(window_s / SLOT_S))
    current = int(time.time()) // SLOT_S
    pipe = redis.pipeline(transaction=False)
    for slot in range(current - slots, current):
        pipe.hgetall(latency_key(deployment, slot, metric))
    return pipe, slots


async def latency_stats(redis: Any, deployment: str, window_s: int) -> LatencyStats:
    """QPS and P99 over the last `window_s` seconds (async Redis: the gateway)."""
    pipe, slots = _window(redis, deployment, window_s)
    return _stats(await pipe.execute(), slots)


def latency_stats_sync(redis: Any, deployment: str, window_s: int,
                       metric: str = "lat") -> LatencyStats:
    """The same with a blocking client (management API, dashboard)."""
    pipe, slots = _window(redis, deployment, window_s, metric)
    return _stats(pipe.execute(), slots)


def _stats(replies: list[dict[bytes, bytes]], slots: int) -> LatencyStats:
    histogram: dict[int, int] = {}
    for reply in replies:
        for field, count in reply.items():
            bucket = int(field[1:])
            histogram[bucket] = histogram.get(bucket, 0) + int(count)
    samples = sum(histogram.values())
    return LatencyStats(qps=samples / (slots * SLOT_S), p99_ms=percentile(histogram, 0.99),
                        samples=samples, p50_ms=percentile(histogram, 0.5))
