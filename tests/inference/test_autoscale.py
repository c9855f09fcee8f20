"""The scaling rules on a synthetic clock: from zero at once, up after the up delay,
down after the down delay, the last worker only after the zero delay, no flapping."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.autoscale import Observation, ScalePolicy, Scaler

POLICY = ScalePolicy(min_replicas=0, max_replicas=4, target_inflight=4, up_delay_s=2.0,
                     down_delay_s=5.0, zero_delay_s=20.0, max_queue_age_s=3.0)


def run(scaler: Scaler, depth: int, start: float, seconds: float, *, age: float = 0.0,
        tick: float = 0.2) -> list[tuple[float, int, str]]:
    """Feed the same observation for `seconds`; the decisions made (time, replicas, why)."""
    out = []
    t = start
    while t < start + seconds - 1e-9:
        decision = scaler.decide(Observation(depth, age), t)
        if decision is not None:
            out.append((round(t, 3), decision.replicas, decision.reason))
        t += tick
    return out


def test_a_request_at_zero_wakes_a_worker_at_once() -> None:
    scaler = Scaler(POLICY)
    assert run(scaler, 0, 0, 10) == []
    decisions = run(scaler, 1, 10, 0.2)
    assert decisions == [(10, 1, "1 request(s) waiting with no worker (scale from zero)")]


def test_a_burst_scales_up_only_after_the_up_delay() -> None:
    scaler = Scaler(POLICY)
    run(scaler, 0, 0, 5)
    decisions = run(scaler, 16, 5, 5)  # 16 in flight at 4 per worker: 4 workers
    assert decisions[0][:2] == (5, 4)  # from zero, straight to what the burst needs
    scaler = Scaler(POLICY, replicas=1)
    run(scaler, 2, 0, 5)
    decisions = run(scaler, 16, 5, 5)
    assert [d[1] for d in decisions] == [4]
    assert 7.0 <= decisions[0][0] <= 7.4  # the burst had to last the 2 s up delay


def test_a_short_spike_does_not_scale_up() -> None:
    scaler = Scaler(POLICY, replicas=1)
    run(scaler, 2, 0, 5)
    assert run(scaler, 16, 5, 1.0) == []  # shorter than the up delay
    assert run(scaler, 2, 6, 10) == []


def test_idle_goes_to_one_after_the_down_delay_then_to_zero_after_the_zero_delay() -> None:
    scaler = Scaler(POLICY)
    run(scaler, 16, 0, 5)
    assert scaler.replicas == 4
    decisions = run(scaler, 0, 5, 40)
    assert [d[1] for d in decisions] == [1, 0]
    (t_one, _, why_one), (t_zero, _, why_zero) = decisions
    assert 10.0 <= t_one <= 10.4  # the down delay: 5 s of no demand
    assert 25.0 <= t_zero <= 25.4  # the zero delay: 20 s idle
    assert "scale to zero" in why_zero and "needs 1" in why_one


def test_min_replicas_is_kept_and_max_is_never_passed() -> None:
    policy = ScalePolicy(min_replicas=2, max_replicas=3, target_inflight=1, up_delay_s=0,
                         down_delay_s=0, zero_delay_s=0)
    scaler = Scaler(policy)
    assert run(scaler, 0, 0, 1)[0][1:] == (2, "below the minimum of 2")
    run(scaler, 100, 1, 5)
    assert scaler.replicas == 3
    run(scaler, 0, 6, 5)
    assert scaler.replicas == 2


def test_a_queue_that_waits_too_long_gets_one_more_worker() -> None:
    scaler = Scaler(POLICY, replicas=1)
    run(scaler, 3, 0, 5)  # 3 in flight: one worker is enough by count
    decisions = run(scaler, 3, 5, 5, age=4.0)  # ... but the oldest waits 4 s
    assert decisions and decisions[0][1] == 2 and "oldest waited 4.0s" in decisions[0][2]


def test_steady_load_at_the_threshold_does_not_flap() -> None:
    rng = random.Random(7)
    scaler = Scaler(POLICY, replicas=2)
    decisions = []
    t = 0.0
    for _ in range(3000):  # 10 minutes of a load hovering at 2 workers' worth
        decision = scaler.decide(Observation(rng.choice([6, 7, 8, 9, 10]), 0.0), t)
        if decision is not None:
            decisions.append(decision)
        t += 0.2
    assert len(decisions) <= 1, decisions


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=40), min_size=10, max_size=400))
def test_changes_are_separated_by_the_delays(depths: list[int]) -> None:
    """Whatever the load, two changes in opposite directions are never closer than the
    shorter stabilization window, and the count stays within [min, max]."""
    scaler = Scaler(POLICY)
    last: tuple[float, int] | None = None
    for i, depth in enumerate(depths):
        now = i * 0.2
        before = scaler.replicas
        decision = scaler.decide(Observation(depth, 0.0), now)
        assert POLICY.min_replicas <= scaler.replicas <= POLICY.max_replicas
        if decision is None or before == 0:
            continue
        direction = 1 if decision.replicas > before else -1
        if last is not None and last[1] != direction:
            assert now - last[0] >= POLICY.up_delay_s - 1e-9
        last = (now, direction)


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        ScalePolicy(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="target_inflight"):
        ScalePolicy(target_inflight=0)
