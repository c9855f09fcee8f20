"""Admission order: priority classes first, then round-robin across tenants."""

from __future__ import annotations

from dataclasses import dataclass

from inference.scheduler import pick


@dataclass(frozen=True)
class W:
    name: str
    tenant: str
    priority: int = 0


def names(items: list[W]) -> list[str]:
    return [w.name for w in items]


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
