"""inference/routing.py alone: the order in which a call tries an alias's deployments."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from inference.routing import Plan, Route, Skip, Target, backoff_s, plan


def _route(weights: dict[str, int], fallbacks: tuple[str, ...] = (),
           context: dict[str, int] | None = None) -> Route:
    ctx = context or {}
    return Route(alias="chat",
                 targets=tuple(Target(n, w, ctx.get(n, 0)) for n, w in weights.items()),
                 fallbacks=tuple(Target(n, 1, ctx.get(n, 0)) for n in fallbacks))


def test_weighted_aliases_split_calls_as_configured_within_a_tolerance() -> None:
    # Given weights 70/20/10 and a seeded source; when 20,000 calls are planned; then
    # each target is tried first in its share of them, within one percentage point
    # (the binomial standard deviation at 20,000 draws is at most 0.36 point).
    rng = random.Random(1234)
    route = _route({"a": 70, "b": 20, "c": 10})
    n = 20_000
    firsts = Counter(plan(route, rng=rng).order[0] for _ in range(n))
    shares = {name: firsts[name] / n for name in "abc"}
    assert shares["a"] == pytest.approx(0.70, abs=0.01), shares
    assert shares["b"] == pytest.approx(0.20, abs=0.01), shares
    assert shares["c"] == pytest.approx(0.10, abs=0.01), shares


def test_a_failed_first_choice_moves_to_the_other_targets_by_weight_then_fallbacks() -> None:
    rng = random.Random(7)
    route = _route({"a": 3, "b": 1}, fallbacks=("f1", "f2"))
    seconds: Counter[str] = Counter()
    for _ in range(8_000):
        order = plan(route, rng=rng).order
        assert sorted(order[:2]) == ["a", "b"] and order[2:] == ("f1", "f2")
        seconds[order[1]] += 1
    # b is second whenever a was first (3/4 of the calls).
    assert seconds["b"] / 8_000 == pytest.approx(0.75, abs=0.02)


def test_unavailable_deployments_are_skipped_with_their_reason() -> None:
    route = Route(alias="chat", targets=(Target("a"), Target("b"), Target("off", 5,
                                                                          enabled=False)),
                  fallbacks=(Target("f"),))
    result = plan(route, rng=random.Random(0),
                  unavailable={"a": Skip.BREAKER_OPEN, "f": Skip.BREAKER_OPEN})
    assert result == Plan(order=("b",), skipped={
        "a": Skip.BREAKER_OPEN, "off": Skip.DISABLED, "f": Skip.BREAKER_OPEN})


def test_a_prompt_too_long_for_a_deployment_goes_to_one_with_room() -> None:
    route = _route({"small": 1}, fallbacks=("large",),
                   context={"small": 2048, "large": 32_768})
    result = plan(route, rng=random.Random(0), prompt_bound=4000)
    assert result.order == ("large",)
    assert result.skipped == {"small": Skip.CONTEXT}
    assert not result.only_context
    fits = plan(route, rng=random.Random(0), prompt_bound=2048)
    assert fits.order == ("small", "large")


def test_a_clamping_deployment_is_planned_when_its_context_holds_the_prompt_alone() -> None:
    # Given a deployment that clamps max_tokens and one that refuses, both of 2,048
    route = Route("a", targets=(Target("clamps", 1, 2048, clamps=True),
                                Target("refuses", 1, 2048)))
    # When a 1,000-token prompt asks for 32,000 tokens of reply
    result = plan(route, rng=random.Random(0), prompt_bound=33_000, reply=32_000)
    # Then only the clamping one is tried; a prompt that fills its context leaves it out
    assert result.order == ("clamps",) and result.skipped == {"refuses": Skip.CONTEXT}
    assert plan(route, rng=random.Random(0), prompt_bound=34_048, reply=32_000).only_context


def test_too_long_everywhere_is_told_apart_from_an_outage() -> None:
    route = _route({"small": 1}, context={"small": 100})
    assert plan(route, rng=random.Random(0), prompt_bound=101).only_context
    down = plan(route, rng=random.Random(0), unavailable={"small": Skip.BREAKER_OPEN})
    assert down.order == () and not down.only_context


def test_a_deployment_both_target_and_fallback_is_tried_once() -> None:
    route = _route({"a": 1, "b": 1}, fallbacks=("a", "c"))
    order = plan(route, rng=random.Random(3)).order
    assert sorted(order[:2]) == ["a", "b"] and order[2:] == ("c",)


def test_the_same_seed_gives_the_same_plans() -> None:
    route = _route({"a": 5, "b": 3, "c": 2}, fallbacks=("z",))
    first = [plan(route, rng=random.Random(99)).order for _ in range(3)]
    rng1, rng2 = random.Random(42), random.Random(42)
    assert [plan(route, rng=rng1).order for _ in range(50)] == \
        [plan(route, rng=rng2).order for _ in range(50)]
    assert first[0] == first[1] == first[2]


def test_backoff_grows_with_full_jitter_up_to_its_cap() -> None:
    rng = random.Random(5)
    assert backoff_s(0, rng=rng) == 0.0
    for attempt, ceiling in [(1, 0.05), (2, 0.1), (3, 0.2), (10, 2.0), (200, 2.0)]:
        pauses = [backoff_s(attempt, rng=rng) for _ in range(500)]
        assert all(0.0 <= p <= ceiling for p in pauses)
        assert max(pauses) > 0.8 * ceiling  # jitter spans the range, not a constant


def test_a_prefix_key_picks_a_consistent_target_shared_by_weight() -> None:
    """Weighted rendezvous hashing: the same key, the same order; keys shared by weight;
    a target that leaves moves only its own keys."""
    route = Route("a", (Target("x", weight=3), Target("y", weight=1), Target("z", weight=1)))
    keys = [f"prefix-{i}".encode() for i in range(3000)]
    first = {k: plan(route, rng=random.Random(), affinity=k).order for k in keys}
    assert all(plan(route, rng=random.Random(), affinity=k).order == first[k] for k in keys[:50])
    share = sum(order[0] == "x" for order in first.values()) / len(keys)
    assert 0.55 < share < 0.65  # 3 / 5
    assert all(sorted(order) == ["x", "y", "z"] for order in first.values())
    down = {k: plan(route, rng=random.Random(), affinity=k, unavailable={"y": Skip.BREAKER_OPEN})
            for k in keys}
    for key, planned in down.items():
        if first[key][0] != "y":
            assert planned.order[0] == first[key][0]  # nobody else's key moved
        assert planned.skipped == {"y": Skip.BREAKER_OPEN}
