"""The breaker scripts' state machine with Redis' own clock (short waits), and the
worker-side memory guard's hysteresis."""

from __future__ import annotations

import time

import pytest
import redis

from governance import breaker
from governance.breaker import Outcome, Snapshot, State
from governance.models import BreakerPolicy
from inference.engine.memory import MemoryGuard

pytestmark = pytest.mark.cluster

DEP = "brk"


def policy(**kw: object) -> BreakerPolicy:
    base: dict[str, object] = {"window_kind": "count", "window_size": 10, "min_calls": 4,
                               "failure_rate": 0.5, "slow_call_ms": 1000,
                               "slow_call_rate": 1.0, "open_wait_s": 0.3,
                               "half_open_probes": 2, "probe_timeout_s": 0.4}
    base.update(kw)
    return BreakerPolicy(**base)


def admit(rds: redis.Redis, p: BreakerPolicy, probe_id: str = "x") -> int:
    verdict, _ = rds.eval(breaker.ADMIT_LUA, 4, *breaker.keys(DEP),
                          *breaker.admit_args(probe_id, p))
    return int(verdict)


def record(rds: redis.Redis, p: BreakerPolicy, outcome: Outcome, ms: float = 10,
           probe_id: str = "") -> str:
    state = rds.eval(breaker.RECORD_LUA, 4, *breaker.keys(DEP),
                     *breaker.record_args(probe_id, [(outcome, ms)], p))
    return state.decode()


def snap(rds: redis.Redis, p: BreakerPolicy) -> Snapshot:
    return Snapshot.from_reply(rds.eval(breaker.PEEK_LUA, 4, *breaker.keys(DEP),
                                        *breaker.peek_args(p)))


def admit_as(rds: redis.Redis, p: BreakerPolicy, tenant: str, probe_id: str = "x") -> int:
    verdict, _ = rds.eval(breaker.ADMIT_LUA, 4, *breaker.keys(DEP),
                          *breaker.admit_args(probe_id, p, tenant))
    return int(verdict)


def record_as(rds: redis.Redis, p: BreakerPolicy, calls: list[tuple[str, Outcome]],
              probe_id: str = "") -> str:
    state = rds.eval(breaker.RECORD_LUA, 4, *breaker.keys(DEP), *breaker.record_args(
        probe_id, [(outcome, 10.0, tenant) for tenant, outcome in calls], p))
    return state.decode()


def test_min_volume_is_respected(rds: redis.Redis) -> None:
    p = policy()
    for _ in range(3):
        assert record(rds, p, Outcome.FAILURE) == "closed"  # 3 of 3 failed, but 3 < 4 calls
    assert record(rds, p, Outcome.FAILURE) == "open"


def test_closed_open_half_open_closed(rds: redis.Redis) -> None:
    p = policy()
    for outcome in (Outcome.SUCCESS, Outcome.SUCCESS, Outcome.FAILURE):
        record(rds, p, outcome)
    assert admit(rds, p) == 1
    assert record(rds, p, Outcome.FAILURE) == "open"  # 2 of 4 >= 50 %
    assert admit(rds, p) == 0
    s = snap(rds, p)
    assert s.state == State.OPEN and s.reason == "failure rate" and s.times_opened == 1
    time.sleep(0.35)
    assert admit(rds, p, "p1") == 2  # half open: a probe
    assert admit(rds, p, "p2") == 2
    assert admit(rds, p, "p3") == 0  # only two probes
    assert record(rds, p, Outcome.SUCCESS, probe_id="p1") == "half_open"
    assert record(rds, p, Outcome.SUCCESS, probe_id="p2") == "closed"
    assert admit(rds, p) == 1
    assert snap(rds, p).calls == 0  # the window starts afresh


def test_failed_probe_reopens(rds: redis.Redis) -> None:
    p = policy(min_calls=1, window_size=1)
    assert record(rds, p, Outcome.FAILURE) == "open"
    time.sleep(0.35)
    assert admit(rds, p, "p1") == 2
    assert record(rds, p, Outcome.FAILURE, probe_id="p1") == "open"
    assert admit(rds, p) == 0
    assert snap(rds, p).times_opened == 2


def test_probe_that_never_reports_reopens(rds: redis.Redis) -> None:
    p = policy(min_calls=1, window_size=1)
    record(rds, p, Outcome.FAILURE)
    time.sleep(0.35)
    assert admit(rds, p, "silent") == 2
    time.sleep(0.45)  # past probe_timeout_s
    assert admit(rds, p, "next") == 0
    assert snap(rds, p).reason == "probe timed out"


def test_slow_calls_open_and_callers_4xx_never_count(rds: redis.Redis) -> None:
    p = policy(slow_call_rate=0.5, failure_rate=1.0)
    for _ in range(10):
        assert record(rds, p, Outcome.IGNORED) == "closed"
    assert snap(rds, p).calls == 0
    record(rds, p, Outcome.SUCCESS, ms=5)
    record(rds, p, Outcome.SUCCESS, ms=5)
    record(rds, p, Outcome.SUCCESS, ms=2000)
    assert record(rds, p, Outcome.SUCCESS, ms=2000) == "open"
    assert snap(rds, p).reason == "slow-call rate"


def test_time_window(rds: redis.Redis) -> None:
    # A 3 s window: the success recorded below stays in it while the next two calls run,
    # also on a loaded machine (with 1 s, a stall in between emptied it: a CI failure)
    p = policy(window_kind="time", window_size=3, min_calls=2)
    record(rds, p, Outcome.FAILURE)
    time.sleep(3.1)  # the first failure leaves the window
    assert record(rds, p, Outcome.SUCCESS) == "closed"
    assert snap(rds, p).calls == 1
    assert record(rds, p, Outcome.FAILURE) == "open"


def test_a_batch_of_outcomes_opens_mid_batch_and_the_count_window_slides(
        rds: redis.Redis) -> None:
    p = policy(window_size=4, min_calls=4)
    batch = [(Outcome.SUCCESS, 1.0)] * 6 + [(Outcome.FAILURE, 1.0)] * 2
    state = rds.eval(breaker.RECORD_LUA, 4, *breaker.keys(DEP),
                     *breaker.record_args("", batch, p))
    assert state == b"open"  # the last four calls: 2 of 4 failed
    rds.delete(*breaker.keys(DEP))
    p = policy(window_size=4, min_calls=4, failure_rate=0.75)
    for outcome in [Outcome.FAILURE] * 2 + [Outcome.SUCCESS] * 3:
        assert record(rds, p, outcome) == "closed"
    s = snap(rds, p)
    assert (s.calls, s.failures) == (4, 1)  # the first failure left the window
    assert record(rds, p, Outcome.FAILURE) == "closed"  # S S S F: the old F slid out
    assert record(rds, p, Outcome.FAILURE) == "closed"  # S S F F
    assert record(rds, p, Outcome.FAILURE) == "open"  # S F F F: 3 of 4


def test_results_of_calls_admitted_before_opening_are_ignored(rds: redis.Redis) -> None:
    p = policy(min_calls=1, window_size=1)
    record(rds, p, Outcome.FAILURE)
    assert record(rds, p, Outcome.SUCCESS) == "open"


@pytest.mark.parametrize("hold", [0.0, 5.0])
def test_memory_guard_hysteresis(hold: float) -> None:
    g = MemoryGuard(high=0.9, low=0.8, hold_s=hold)
    assert g.observe(85, 100, 0.0)  # between the marks, still in rotation
    assert not g.observe(92, 100, 1.0)  # above high: out
    assert not g.observe(85, 100, 2.0)  # below high but above low: still out
    assert not g.observe(70, 100, 3.0)  # below low: the hold starts
    if hold:
        assert not g.observe(70, 100, 7.9)
        assert not g.observe(81, 100, 8.0)  # back above low: the hold restarts
        assert not g.observe(70, 100, 9.0)
        assert not g.observe(70, 100, 13.9)
        assert g.observe(70, 100, 14.0)
    else:
        assert g.observe(70, 100, 3.0)
    g.configure(high=0.5, low=0.6, hold_s=1)  # garbled (low > high): ignored
    assert (g.high, g.low) == (0.9, 0.8)


# -- one tenant alone never opens it for everyone --------------------------------------
@pytest.mark.parametrize("kind", ["count", "time"])
def test_one_tenants_failures_among_others_successes_refuse_that_tenant_alone(
        rds: redis.Redis, kind: str) -> None:
    # open_wait_s 2: the refusals below are asserted within it on a loaded machine
    p = policy(window_kind=kind, window_size=10 if kind == "count" else 60, min_calls=6,
               open_wait_s=2)
    # given bob's calls succeed, when alice's fail (4 of 6 calls: over the 50 %)
    calls = [("bob", Outcome.SUCCESS)] * 2 + [("alice", Outcome.FAILURE)] * 4
    assert record_as(rds, p, calls) == "closed"
    scoped = time.monotonic()  # alice's scope began before this: it ends by +2 s
    # then alice alone is refused, for open_wait_s; bob and everyone else still pass
    assert admit_as(rds, p, "alice") == 0
    assert admit_as(rds, p, "bob") == 1 and admit_as(rds, p, "carol") == 1
    s = snap(rds, p)
    assert s.state == State.CLOSED and s.tenants_open == ("alice",)
    assert (s.calls, s.times_tenant_opened) == (0, 1)  # the window starts again
    time.sleep(max(0.0, scoped + 2.05 - time.monotonic()))  # the breaker's own clock
    assert admit_as(rds, p, "alice") == 1
    assert snap(rds, p).tenants_open == ()


def test_failures_from_two_tenants_open_it_for_everyone_as_fast_as_before(
        rds: redis.Redis) -> None:
    p = policy(min_calls=4, open_wait_s=30)  # no wait ends during the test
    assert record_as(rds, p, [("alice", Outcome.FAILURE), ("bob", Outcome.FAILURE),
                              ("alice", Outcome.FAILURE)]) == "closed"
    assert record_as(rds, p, [("bob", Outcome.FAILURE)]) == "open"  # the 4th call, as before
    assert admit_as(rds, p, "carol") == 0
    assert snap(rds, p).opened_by == ""


def test_the_only_callers_failures_open_it_and_another_tenant_probes_it_at_once(
        rds: redis.Redis) -> None:
    p = policy(min_calls=4, open_wait_s=30, probe_timeout_s=30)  # none ends in the test
    assert record_as(rds, p, [("alice", Outcome.FAILURE)] * 4) == "open"
    assert snap(rds, p).opened_by == "alice"
    assert admit_as(rds, p, "alice") == 0  # the deployment is protected from alice
    # bob's calls probe it now, not after open_wait_s; theirs succeeding close it
    assert admit_as(rds, p, "bob", "p1") == 2 and admit_as(rds, p, "bob", "p2") == 2
    assert admit_as(rds, p, "bob", "p3") == 0  # two probes at a time, as half open
    assert record_as(rds, p, [("bob", Outcome.SUCCESS)], probe_id="p1") == "open"
    assert record_as(rds, p, [("bob", Outcome.SUCCESS)], probe_id="p2") == "closed"
    assert admit_as(rds, p, "bob") == 1
    assert admit_as(rds, p, "alice") == 0  # for the rest of its wait
    assert snap(rds, p).tenants_open == ("alice",)
    # a real outage: another tenant's probe failing opens it for everyone
    rds.delete(*breaker.keys(DEP))
    record_as(rds, p, [("alice", Outcome.FAILURE)] * 4)
    assert admit_as(rds, p, "bob", "p1") == 2
    assert record_as(rds, p, [("bob", Outcome.FAILURE)], probe_id="p1") == "open"
    assert admit_as(rds, p, "bob") == 0 and admit_as(rds, p, "carol") == 0
    assert snap(rds, p).opened_by == ""


def test_a_stray_failure_of_another_tenant_does_not_let_one_tenant_open_it(
        rds: redis.Redis) -> None:
    p = policy(window_size=20, min_calls=10, open_wait_s=30)
    # bob: one failure in five calls (20 %, under the 50 %); alice: all of hers fail
    calls = [("bob", Outcome.SUCCESS)] * 4 + [("bob", Outcome.FAILURE)] + \
        [("alice", Outcome.FAILURE)] * 5
    assert record_as(rds, p, calls) == "closed"
    assert admit_as(rds, p, "alice") == 0 and admit_as(rds, p, "bob") == 1
