"""Token-bucket rate limiting in one atomic Redis script.

Every bucket of a request (tenant, API key, tenant x model; requests and tokens) is
checked and debited in a single EVALSHA, all or nothing, with the time taken from Redis
(`TIME`), so any number of gateway processes share one exact view and no caller's clock
matters. A bucket holds at most `capacity` (the burst) and refills at `rate` per second:
over any interval T a bucket admits at most capacity + rate x T, so a 100/min limit with
a burst of 10 admits at most 110 in a minute, and the fixed-window boundary trick (100 at
59.9 s, 100 more at 60.1 s) gets the burst, not a second minute.

A request costing more than a bucket's capacity (a large token estimate) waits for a full
bucket and then goes into debt, which the refill pays back: large requests are slowed,
never starved. Token buckets are debited the estimate up front and corrected with the real
usage afterwards (`force` mode).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from governance.models import RateLimitPolicy
from governance.ranges import FACTOR_MAX

# KEYS: buckets. ARGV[1]: "check" (all or nothing) or "force" (debit regardless);
# ARGV[2]: "" (Redis' clock: what the gateway always sends) or a time in seconds (tests
# drive the clock); then per bucket: rate per second, capacity, cost.
# Returns {allowed, wait_ms, remaining_1, full_in_ms_1, remaining_2, full_in_ms_2, ...}.
BUCKETS_LUA = """
local now = tonumber(ARGV[2])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local force = ARGV[1] == 'force'
local rates, caps, costs, levels, wait, denied = {}, {}, {}, {}, 0, false
for i, key in ipairs(KEYS) do
  local rate, cap, cost = tonumber(ARGV[3*i]), tonumber(ARGV[3*i+1]), tonumber(ARGV[3*i+2])
  rates[i], caps[i], costs[i] = rate, cap, cost
  local h = redis.call('HMGET', key, 'v', 't')
  local level = cap
  if h[1] then
    level = math.min(cap, tonumber(h[1]) + math.max(0, now - tonumber(h[2])) * rate)
  end
  levels[i] = level
  local need = math.min(cost, cap)
  if not force and level < need then
    denied = true
    wait = math.max(wait, (need - level) / rate)
  end
end
local out = {denied and 0 or 1, math.ceil(wait * 1000)}
local stamp = tostring(now)  -- number-to-string is the dearest step here: once a call
for i, key in ipairs(KEYS) do
  local rate, cap, level = rates[i], caps[i], levels[i]
  if not denied then
    level = math.min(cap, level - costs[i])
    redis.call('HSET', key, 'v', tostring(level), 't', stamp)
    redis.call('PEXPIRE', key, math.ceil((cap - level) / rate * 1000) + 1000)
  end
  out[#out + 1] = math.floor(level)
  out[#out + 1] = math.ceil(math.max(0, cap - level) / rate * 1000)
end
return out
"""


@dataclass(frozen=True)
class Bucket:
    key: str
    kind: str  # "requests" | "tokens"
    per_minute: float  # the effective limit (after the adaptive factor)
    capacity: float
    # (refill per second, capacity) as BUCKETS_LUA reads them: made once per bucket.
    wire: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "wire", (repr(self.rate_per_s), repr(self.capacity)))

    @property
    def rate_per_s(self) -> float:
        return max(self.per_minute / 60.0, 1e-9)


@dataclass(frozen=True)
class BucketState:
    bucket: Bucket
    remaining: int
    full_in_ms: int


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    wait_s: float
    states: list[BucketState]

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers, from the tightest bucket of each kind."""
        tightest: dict[str, BucketState] = {}
        for state in self.states:
            held = tightest.get(state.bucket.kind)
            if held is None or state.remaining < held.remaining:
                tightest[state.bucket.kind] = state
        out: dict[str, str] = {}
        for kind in ("requests", "tokens"):
            tight = tightest.get(kind)
            if tight is None:
                continue
            out[f"x-ratelimit-limit-{kind}"] = str(int(tight.bucket.per_minute))
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, tight.remaining))
            out[f"x-ratelimit-reset-{kind}"] = duration(tight.full_in_ms / 1000)
        return out


def duration(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{int(rest)}s"


def default_burst(per_minute: float) -> float:
    return max(1.0, math.ceil(per_minute / 10))


def bucket_key(tenant: str, policy_id: int, kind: str, subject: str) -> str:
    return f"sluice:{{{tenant}}}:rl:{policy_id}:{kind[0]}:{subject}"


_MADE: dict[tuple[Any, ...], tuple[Bucket, ...]] = {}
_MADE_MAX = 10_000  # distinct (policy, subject, factor): an adaptive factor moves


def buckets_for(policy: RateLimitPolicy, *, tenant: str, subject: str,
                factor: float) -> list[Bucket]:
    """The request and token buckets one policy puts on one subject (tenant, key id or
    model name), with the refill scaled by the adaptive factor. Made once per policy
    version, subject and factor (every call asks; ~5 µs each)."""
    key = (policy.pk, policy.requests_per_minute, policy.tokens_per_minute,
           policy.burst_requests, policy.burst_tokens, tenant, subject, factor)
    made = _MADE.get(key)
    if made is None:
        if len(_MADE) >= _MADE_MAX:
            _MADE.clear()
        made = _MADE[key] = tuple(_make_buckets(policy, tenant, subject, factor))
    return list(made)


def _make_buckets(policy: RateLimitPolicy, tenant: str, subject: str,
                  factor: float) -> list[Bucket]:
    out = []
    for kind, rate, burst in (("requests", policy.requests_per_minute, policy.burst_requests),
                              ("tokens", policy.tokens_per_minute, policy.burst_tokens)):
        if rate is None:
            continue
        out.append(Bucket(key=bucket_key(tenant, policy.pk, kind, subject), kind=kind,
                          per_minute=rate * factor,
                          capacity=float(burst if burst is not None else default_burst(rate))))
    return out


def adaptive_factor(policy: RateLimitPolicy, qps: float, p99_ms: float | None) -> float:
    """clamp(QPS / qps_ref, qps_min, qps_max) x max(1 - slope x (P99 - target), floor),
    within [0, FACTOR_MAX].

    Without latency samples the latency term is 1 (nothing to react to yet). Total: a
    policy that makes no number (qps_ref 0, NaN; the hot path's are clamped on load,
    governance.ranges.sane, but the management API reads rows as stored) gives 1."""
    if not policy.adaptive:
        return 1.0
    try:
        factor = min(max(qps / policy.qps_ref, policy.qps_min), policy.qps_max)
        if p99_ms is not None:
            factor *= max(1.0 - policy.p99_slope * (p99_ms - policy.p99_target_ms),
                          policy.floor)
    except ArithmeticError:
        return 1.0
    return min(max(factor, 0.0), FACTOR_MAX) if math.isfinite(factor) else 1.0


def args_for(buckets: list[Bucket], costs: Sequence[float], mode: str,
             clock: float | None = None) -> list[Any]:
    args: list[Any] = [mode, "" if clock is None else repr(clock)]
    for bucket, cost in zip(buckets, costs, strict=True):
        args += [*bucket.wire, repr(float(cost))]
    return args


def verdict(buckets: list[Bucket], reply: list[int]) -> Verdict:
    states = [BucketState(b, int(reply[2 + 2 * i]), int(reply[3 + 2 * i]))
              for i, b in enumerate(buckets)]
    return Verdict(bool(reply[0]), int(reply[1]) / 1000, states)
