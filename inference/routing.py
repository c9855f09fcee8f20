"""Which deployments a call to a model alias tries, in which order. Pure: no I/O, no
clock, the random source passed in, so it is tested alone (like inference/engine/scheduler.py).

An alias (inference/models.py ModelAlias) has weighted targets and ordered fallbacks.
`plan` orders them for one call:
1. the available targets, drawn one after another without replacement, each draw with
   probability weight / (sum of the weights still in the draw): the first deployment
   tried is target i with probability weight_i / sum(weights), and when it fails the
   call moves to another target before any fallback;
2. then the available fallbacks, in their configured order.
With an `affinity` (a hash of the call's leading messages and tools: its prefix), step 1
is deterministic instead: the targets in the order of their weighted rendezvous scores
for that key (highest random weight: -weight / ln(u), u a uniform draw seeded by the key
and the deployment's name), so calls that share a prefix go to the same target, whose
own prefix cache then holds it (vLLM's, SGLang's), the targets still share distinct
prefixes by weight, and a target leaving moves only the prefixes it had.
A deployment is unavailable, and skipped with its reason, when it is disabled, when the
caller says so (its breaker open: `unavailable`) or when its context cannot hold the call
(`prompt_bound`: the prompt's tokens plus the reply's maximum, a bound the caller
computes; for a deployment that clamps the reply's maximum, `clamps`, the prompt's
alone, which must leave it room for one token: `reply` is the part of `prompt_bound`
that is the reply's). A deployment listed both as a target and as a fallback is tried once.

`lane` places a call among one deployment's workers the same way: the live worker in
rotation with the highest rendezvous score for the call's prefix key gets it in its lane
(inference/queue.py), unless its last heartbeat says its batch is full; with fewer than
two such workers, or a full one, the call goes to the shared stream (any worker).

`backoff_s` is the pause before the next attempt after a retriable failure: capped
exponential with full jitter (AWS's "exponential backoff and jitter"), so callers that
failed together do not retry together.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class Skip(StrEnum):
    """Why a deployment is left out of a call's plan."""

    DISABLED = "disabled"
    BREAKER_OPEN = "breaker_open"
    CONTEXT = "context_too_small"


@dataclass(frozen=True)
class Target:
    deployment: str
    weight: int = 1  # fallbacks: unused
    max_context: int = 0  # 0: unknown, never skipped for context
    enabled: bool = True
    clamps: bool = False  # a call's max_tokens is lowered to fit, not refused


@dataclass(frozen=True)
class Route:
    """An alias as routing reads it: `targets` share the calls by weight (each weight
    >= 1), `fallbacks` are tried in order after them."""

    alias: str
    targets: tuple[Target, ...]
    fallbacks: tuple[Target, ...] = ()
    clamps: bool = False  # the alias's own max_tokens policy is clamp


@dataclass(frozen=True)
class Plan:
    """The deployments to try, first to last, and those left out with why."""

    order: tuple[str, ...]
    skipped: dict[str, Skip] = field(default_factory=dict)

    @property
    def only_context(self) -> bool:
        """Nothing to try and every deployment left out for its context: the caller's
        prompt is too long for this alias (a 400, not an outage)."""
        return not self.order and bool(self.skipped) and \
            all(why is Skip.CONTEXT for why in self.skipped.values())


def plan(route: Route, *, rng: random.Random,
         unavailable: Mapping[str, Skip] | None = None, prompt_bound: int = 0,
         reply: int = 0, affinity: bytes | None = None) -> Plan:
    """The order in which one call tries `route`'s deployments (see the module's
    docstring). `rng` draws the weighted order (unless `affinity` keys it);
    `unavailable` names deployments that must not be tried now and why; `prompt_bound`
    is the call's tokens at most, `reply` the part of it a clamping deployment lowers."""
    down = unavailable or {}
    skipped: dict[str, Skip] = {}
    seen: set[str] = set()

    def usable(target: Target) -> bool:
        name = target.deployment
        if name in seen or name in skipped:
            return False
        if not target.enabled:
            skipped[name] = Skip.DISABLED
            return False
        if name in down:
            skipped[name] = down[name]
            return False
        if target.max_context and (
                prompt_bound - reply >= target.max_context if target.clamps
                else prompt_bound > target.max_context):
            skipped[name] = Skip.CONTEXT
            return False
        seen.add(name)
        return True

    pool = [t for t in route.targets if usable(t)]
    order: list[str] = []
    if affinity is not None:
        pool.sort(key=lambda t: _score(affinity, t), reverse=True)
        order, pool = [t.deployment for t in pool], []
    while pool:
        pick = _weighted_index([t.weight for t in pool], rng)
        order.append(pool.pop(pick).deployment)
    order += [t.deployment for t in route.fallbacks if usable(t)]
    return Plan(order=tuple(order), skipped=skipped)


def lane(affinity: bytes, beats: Mapping[str, Mapping[str, object]]) -> str:
    """The worker whose lane a call with prefix key `affinity` goes to, "" for the
    shared stream (see the module); `beats`: the live workers' heartbeats by id."""
    ready = [w for w, beat in beats.items() if beat.get("in_rotation", True)]
    if len(ready) < 2:
        return ""
    chosen = max(ready, key=lambda w: _score(affinity, Target(w)))
    beat = beats[chosen]
    load, room = beat.get("load", 0), beat.get("max_batch", 0)
    if isinstance(load, int) and isinstance(room, int) and room and load >= room:
        return ""
    return chosen


def _score(affinity: bytes, target: Target) -> float:
    """`target`'s weighted rendezvous score for `affinity` (see the module)."""
    digest = hashlib.blake2b(affinity + target.deployment.encode(), digest_size=8).digest()
    uniform = (int.from_bytes(digest, "big") + 1) / (2**64 + 1)  # in (0, 1)
    return -target.weight / math.log(uniform)


def _weighted_index(weights: list[int], rng: random.Random) -> int:
    """Index i with probability weights[i] / sum(weights) (all weights >= 1)."""
    point = rng.random() * sum(weights)
    for i, weight in enumerate(weights):
        point -= weight
        if point < 0:
            return i
    return len(weights) - 1  # rounding at the very top of the range


def backoff_s(attempt: int, *, rng: random.Random, base_s: float = 0.05,
              cap_s: float = 2.0) -> float:
    """The pause before attempt `attempt` + 1 (attempt 1 is the first retry): uniform
    in [0, min(cap, base * 2 ** (attempt - 1))]."""
    if attempt < 1:
        return 0.0
    return rng.uniform(0.0, min(cap_s, base_s * 2 ** min(attempt - 1, 30)))
