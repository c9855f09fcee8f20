"""Admission order: priority classes first, then round-robin across tenants; each
tenant's share of the running slots while others wait, and who gives way to whom."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from inference.engine.scheduler import admit, pick, preempt, share_cap


@dataclass(frozen=True)
class W:
    name: str
    tenant: str
    priority: int = 0


@dataclass(frozen=True)
class D:
    name: str
    tenant: str
    priority: int = 0
    deliveries: int = 1
    deadline_ms: int = 10**12


def names(items: list[W] | list[D]) -> list[str]:
    return [w.name for w in items]


def ds(tenant: str, n: int, *, prefix: str = "") -> list[D]:
    return [D(f"{prefix or tenant}{i}", tenant) for i in range(n)]


def test_one_tenants_flood_does_not_starve_another() -> None:
    waiting = [W(f"a{i}", "alice") for i in range(10)] + [W("b0", "bob")]
    assert names(pick(waiting, 2)) == ["a0", "b0"]


def test_round_robin_keeps_each_tenants_order() -> None:
    waiting = [W("a0", "a"), W("a1", "a"), W("b0", "b"), W("c0", "c"), W("b1", "b")]
    assert names(pick(waiting, 5)) == ["a0", "b0", "c0", "a1", "b1"]


def test_rounds_rotate_across_calls() -> None:
    waiting = [W("a0", "a"), W("a1", "a"), W("b0", "b"), W("b1", "b")]
    assert names(pick(waiting, 1, after_tenant="a")) == ["b0"]
    assert names(pick(waiting, 1, after_tenant="b")) == ["a0"]


def test_higher_priority_first_even_if_later() -> None:
    waiting = [W("low0", "a"), W("low1", "b"), W("high", "a", priority=5)]
    assert names(pick(waiting, 2)) == ["high", "low0"]


def test_capacity_and_empty() -> None:
    assert pick([], 3) == []
    assert len(pick([W(str(i), "t") for i in range(9)], 4)) == 4


# -- fair share of the running slots ------------------------------------------------


def test_share_cap_is_a_share_of_the_batch_at_least_one_and_range_checked() -> None:
    assert share_cap(8, 0.5) == 4
    assert share_cap(8, 1.0) == 8
    assert share_cap(3, 0.1) == 1
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="share"):
            share_cap(8, bad)


def test_a_limited_pick_stops_a_tenant_at_its_limit() -> None:
    waiting = [W(f"a{i}", "a") for i in range(5)] + [W("b0", "b")]
    assert names(pick(waiting, 6, limits={"a": 2})) == ["a0", "b0", "a1"]
    assert names(pick(waiting, 6, limits={"a": 0, "b": 0})) == []


def test_a_tenant_alone_uses_every_slot() -> None:
    chosen, _ = admit(ds("a", 10), running=0, max_batch_size=8, max_deliveries=3,
                      held={}, cap=4)
    assert len(chosen) == 8


def test_while_others_wait_each_tenant_gets_its_share_then_the_rest_is_shared() -> None:
    waiting = ds("a", 10) + ds("b", 10)
    chosen, _ = admit(waiting, running=0, max_batch_size=8, max_deliveries=3, cap=3)
    assert sorted(names(chosen)) == ["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]
    # A tenant at its share takes nothing while another waits below its own.
    chosen, _ = admit(ds("a", 5) + ds("b", 1), running=4, max_batch_size=6,
                      max_deliveries=3, held={"a": 4}, cap=3)
    assert names(chosen) == ["b0", "a0"], "b first (its share), then the free slot: a"


def test_a_reserve_keeps_a_slot_free_unless_one_tenant_is_all_there_is() -> None:
    chosen, _ = admit(ds("a", 10), running=1, max_batch_size=8, max_deliveries=3,
                      held={"b": 1}, cap=4, reserve=1)
    assert len(chosen) == 6, "one slot stays free for a tenant arriving later"
    chosen, _ = admit(ds("a", 10), running=1, max_batch_size=8, max_deliveries=3,
                      held={"a": 1}, cap=4, reserve=1)
    assert len(chosen) == 7, "alone, a tenant takes every slot"


def test_the_newest_of_a_tenant_over_its_share_give_way_to_a_tenant_below_it() -> None:
    running = ds("a", 8)
    victims = preempt(running, ds("b", 1), max_batch_size=8, cap=4, max_deliveries=3)
    assert names(victims) == ["a7"]
    victims = preempt(running, ds("b", 9), max_batch_size=8, cap=4, max_deliveries=3)
    assert names(victims) == ["a7", "a6", "a5", "a4"], "never below a's own share"


def test_nothing_gives_way_to_a_tenant_alone_at_its_share_or_with_a_free_slot() -> None:
    running = ds("a", 6)
    assert preempt(running, ds("a", 3), max_batch_size=6, cap=3, max_deliveries=3) == []
    assert preempt(running[:5], ds("b", 1), max_batch_size=6, cap=3, max_deliveries=3) == []
    at_share = ds("a", 3) + ds("b", 3)
    assert preempt(at_share, ds("c", 2), max_batch_size=6, cap=3, max_deliveries=3) == []
    held_b = ds("a", 4) + ds("b", 2)  # b waits at its share: nobody gives way to it
    assert preempt(held_b, ds("b", 2, prefix="w"), max_batch_size=6, cap=2,
                   max_deliveries=3) == []


def test_with_three_tenants_the_furthest_over_its_share_gives_way_first() -> None:
    running = ds("a", 5) + ds("b", 3)
    victims = preempt(running, ds("c", 3), max_batch_size=8, cap=2, max_deliveries=3)
    assert names(victims) == ["a4", "a3"], "c may run 2; a is 3 over its share, b 1"
    even = ds("a", 4) + ds("b", 4)
    victims = preempt(even, ds("c", 2), max_batch_size=8, cap=3, max_deliveries=3)
    assert names(victims) == ["a3", "b3"], "each 1 over: one each"
    assert preempt(running, [D("c0", "c", deliveries=3)], max_batch_size=8, cap=2,
                   max_deliveries=3) == [], "a request on its last delivery waits"
