"""The token bucket script: burst and refill, all-or-nothing across buckets, boundary
bursts, a Hypothesis state machine against a reference model, and the adaptive rule."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import redis
from django.conf import settings
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from governance.models import RateLimitPolicy
from governance.ratelimit import (
    BUCKETS_LUA,
    Bucket,
    adaptive_factor,
    args_for,
    buckets_for,
    default_burst,
    duration,
    verdict,
)
from sluice.redis import sync_client

pytestmark = pytest.mark.cluster


def take(rds: redis.Redis, buckets: list[Bucket], costs: list[float], *,
         clock: float | None = None, mode: str = "check") -> Any:
    reply = rds.eval(BUCKETS_LUA, len(buckets), *[b.key for b in buckets],
                     *args_for(buckets, costs, mode, clock))
    return verdict(buckets, reply)


def per_min(key: str, rate: float, burst: float, kind: str = "requests") -> Bucket:
    return Bucket(key=f"sluice:{{t}}:rl:{key}", kind=kind, per_minute=rate, capacity=burst)


def test_burst_then_refill(rds: redis.Redis) -> None:
    b = per_min("a", 100, 10)
    admitted = sum(take(rds, [b], [1], clock=1000.0).allowed for _ in range(50))
    assert admitted == 10
    # 100/min refills one request every 0.6 s
    assert not take(rds, [b], [1], clock=1000.5).allowed
    assert take(rds, [b], [1], clock=1000.61).allowed
    denied = take(rds, [b], [1], clock=1000.62)
    assert not denied.allowed and 0.5 < denied.wait_s <= 0.6


def test_boundary_burst_is_rejected(rds: redis.Redis) -> None:
    """A fixed window admits 100 at 59.9 s and 100 more at 60.1 s; the bucket does not."""
    b = per_min("edge", 100, 10)
    take(rds, [b], [0], clock=0.0)  # the bucket exists from t=0, full
    first = sum(take(rds, [b], [1], clock=59.9).allowed for _ in range(100))
    second = sum(take(rds, [b], [1], clock=60.1).allowed for _ in range(100))
    assert first == 10
    assert second == 0  # 0.2 s refills a third of a request
    assert first + second <= 100 + 10


def test_a_minute_of_steady_pressure_admits_rate_plus_burst(rds: redis.Redis) -> None:
    b = per_min("steady", 100, 10)
    admitted = sum(take(rds, [b], [1], clock=t / 20).allowed for t in range(0, 1200))
    # every 50 ms for 60 s: the burst, then one per 0.6 s
    assert 100 + 10 - 1 <= admitted <= 100 + 10


def test_all_or_nothing_across_buckets(rds: redis.Redis) -> None:
    tenant, key = per_min("tenant", 600, 5), per_min("key", 600, 2)
    assert take(rds, [tenant, key], [1, 1], clock=10.0).allowed
    assert take(rds, [tenant, key], [1, 1], clock=10.0).allowed
    refused = take(rds, [tenant, key], [1, 1], clock=10.0)
    assert not refused.allowed
    # the tenant bucket was not debited by the refused call: 3 left
    states = take(rds, [tenant], [0], clock=10.0).states
    assert states[0].remaining == 3


def test_large_request_waits_for_a_full_bucket_then_goes_into_debt(rds: redis.Redis) -> None:
    tokens = per_min("tok", 6000, 1000, kind="tokens")  # 100 tokens/s
    assert take(rds, [tokens], [2500], clock=0.0).allowed  # full bucket: admitted into debt
    refused = take(rds, [tokens], [10], clock=1.0)
    assert not refused.allowed
    assert refused.wait_s == pytest.approx(14.1, abs=0.01)  # (1400 debt + 10) / 100 per s
    # the settlement refunds an over-estimate
    take(rds, [tokens], [-2000], clock=1.0, mode="force")
    assert take(rds, [tokens], [10], clock=1.0).allowed


def test_headers_follow_openai_names(rds: redis.Redis) -> None:
    b = per_min("h", 60, 3)
    v = take(rds, [b, per_min("ht", 6000, 600, "tokens")], [1, 100], clock=5.0)
    h = v.headers()
    assert h["x-ratelimit-limit-requests"] == "60"
    assert h["x-ratelimit-remaining-requests"] == "2"
    assert h["x-ratelimit-reset-requests"] == "1s"
    assert h["x-ratelimit-limit-tokens"] == "6000"
    assert h["x-ratelimit-remaining-tokens"] == "500"
    assert duration(0.02) == "20ms" and duration(360) == "6m0s"


def test_headers_show_the_tightest_bucket_of_each_kind(rds: redis.Redis) -> None:
    loose, tight = per_min("loose", 600, 60), per_min("tight", 60, 3)
    h = take(rds, [loose, tight], [1, 1], clock=5.0).headers()
    assert h["x-ratelimit-limit-requests"] == "60"
    assert h["x-ratelimit-remaining-requests"] == "2"
    assert "x-ratelimit-limit-tokens" not in h


def test_buckets_follow_an_edited_policy_and_the_adaptive_factor() -> None:
    """buckets_for remembers what it made: an edit of the policy (same id) and a new
    adaptive factor must still give their own buckets."""
    policy = RateLimitPolicy(pk=991, scope="tenant", requests_per_minute=600,
                             tokens_per_minute=6000)
    first = buckets_for(policy, tenant="t", subject="s", factor=1.0)
    assert [(b.kind, b.per_minute, b.capacity) for b in first] == \
        [("requests", 600, 60), ("tokens", 6000, 600)]
    assert buckets_for(policy, tenant="t", subject="s", factor=1.0) == first
    assert [b.per_minute for b in buckets_for(policy, tenant="t", subject="s",
                                              factor=0.5)] == [300, 3000]
    policy.requests_per_minute, policy.burst_requests = 120, 7
    edited = buckets_for(policy, tenant="t", subject="s", factor=1.0)
    assert (edited[0].per_minute, edited[0].capacity) == (120, 7)
    assert edited[0].wire == (repr(2.0), repr(7.0))
    assert buckets_for(policy, tenant="t", subject="other", factor=1.0)[0].key.endswith(
        ":other")


def test_time_comes_from_redis_when_no_clock_is_sent(rds: redis.Redis) -> None:
    b = per_min("real", 60, 1)  # one per second
    assert take(rds, [b], [1]).allowed
    assert not take(rds, [b], [1]).allowed
    time.sleep(1.05)
    assert take(rds, [b], [1]).allowed


def test_default_burst_is_a_tenth_of_a_minute() -> None:
    assert default_burst(100) == 10 and default_burst(5) == 1


def test_adaptive_rule() -> None:
    p = RateLimitPolicy(adaptive=True)
    # rate = base x clamp(QPS/1000, 0.5, 2.0) x max(1 - 0.01 x (P99 - 200), 0.3)
    assert adaptive_factor(p, 1000, 200) == pytest.approx(1.0)
    assert adaptive_factor(p, 100, 200) == pytest.approx(0.5)
    assert adaptive_factor(p, 5000, 200) == pytest.approx(2.0)
    assert adaptive_factor(p, 1000, 250) == pytest.approx(0.5)
    assert adaptive_factor(p, 1000, 10_000) == pytest.approx(0.3)
    assert adaptive_factor(p, 1500, None) == pytest.approx(1.5)
    p.qps_ref, p.floor = 100.0, 0.1
    assert adaptive_factor(p, 100, 10_000) == pytest.approx(0.1)
    assert adaptive_factor(RateLimitPolicy(adaptive=False), 1, 9999) == 1.0


class BucketMachine(RuleBasedStateMachine):
    """Two buckets taken together, against a float model of the same arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.rds = sync_client(settings.REDIS_URL)
        self.now = 1_000_000.0
        self.buckets = [per_min(f"m{id(self)}a", 120, 5), per_min(f"m{id(self)}b", 30, 3)]
        self.levels = [5.0, 3.0]
        self.stamp = [None, None]

    @initialize()
    def clean(self) -> None:
        self.rds.delete(*[b.key for b in self.buckets])

    def _refilled(self) -> list[float]:
        return [min(b.capacity, lvl + (0 if s is None else max(0, self.now - s)) * b.rate_per_s)
                for b, lvl, s in zip(self.buckets, self.levels, self.stamp, strict=True)]

    @rule(dt=st.floats(min_value=0, max_value=30, allow_nan=False))
    def wait(self, dt: float) -> None:
        self.now += dt

    @rule(cost=st.integers(min_value=0, max_value=8), force=st.booleans())
    def take(self, cost: int, force: bool) -> None:
        levels = self._refilled()
        needs = [min(cost, b.capacity) for b in self.buckets]
        near = any(abs(lv - n) < 1e-6 for lv, n in zip(levels, needs, strict=True))
        expect = force or all(lv >= n for lv, n in zip(levels, needs, strict=True))
        got = take(self.rds, self.buckets, [cost, cost], clock=self.now,
                   mode="force" if force else "check")
        if not near:
            assert got.allowed == expect
        if got.allowed:
            self.levels = [min(b.capacity, lv - cost)
                           for b, lv in zip(self.buckets, levels, strict=True)]
            self.stamp = [self.now, self.now]
        for state, level in zip(got.states, self._refilled(), strict=True):
            assert abs(state.remaining - math.floor(level)) <= 1

    @invariant()
    def bounded(self) -> None:
        for b, lv in zip(self.buckets, self._refilled(), strict=True):
            assert lv <= b.capacity


def test_bucket_state_machine(rds: redis.Redis) -> None:
    BucketMachine.TestCase.settings = hsettings(max_examples=60, stateful_step_count=40,
                                                deadline=None)
    BucketMachine.TestCase().runTest()
