"""The hot path's copy of a guardrail policy, and which policies one call gets.

Precedence (docs/GUARDRAILS.md has the table): for each guard and phase, the one
enabled policy of the most specific scope that matches the call applies: its API key,
then its deployment or alias (the name the caller asked for), then its tenant, then the
platform; at the same scope a tenant's own policy before the platform's, then the
newest. A more specific policy replaces a less specific one of the same guard and
phase, even to weaken it (a `flag` key policy under a tenant's `block`, or a disabled
one that switches the guard off for that key). A platform policy marked `mandatory`
applies besides, whatever was chosen: a tenant cannot weaken or switch it off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from governance.guardrail_models import GuardrailPolicy, GuardScope

# Rank of a scope: lower is more specific.
_RANK = {GuardScope.KEY: 0, GuardScope.DEPLOYMENT: 1, GuardScope.TENANT: 2,
         GuardScope.PLATFORM: 3}


@dataclass(frozen=True, slots=True)
class Policy:
    """A policy row as the gateways read it (read-only, cached with the tenant's other
    policies: governance/cache.py). `secret_sealed` stays sealed until a guard needs
    it."""

    id: int
    name: str
    guard: str
    phase: str
    action: str
    scope: str
    tenant_id: int | None
    key_id: int | None
    deployment: str
    categories: tuple[str, ...]
    config: dict[str, Any] = field(hash=False, compare=False)
    secret_sealed: str = ""
    mandatory: bool = False
    shadow: bool = False
    enabled: bool = True
    timeout_s: float = 1.0
    on_error: str = "open"

    @classmethod
    def of(cls, row: GuardrailPolicy) -> Policy:
        return cls(id=row.pk, name=row.name, guard=row.guard, phase=row.phase,
                   action=row.action, scope=row.scope, tenant_id=row.tenant_id,
                   key_id=row.api_key_id, deployment=row.deployment,
                   categories=tuple(str(c) for c in row.categories or ()),
                   config=dict(row.config or {}), secret_sealed=row.secret_sealed,
                   mandatory=row.mandatory, shadow=row.shadow, enabled=row.enabled,
                   timeout_s=max(1, min(row.timeout_ms, 30_000)) / 1000,
                   on_error=row.on_error)

    def matches(self, *, key_id: int | None, model: str) -> bool:
        if self.scope == GuardScope.KEY:
            return key_id is not None and self.key_id == key_id
        if self.scope == GuardScope.DEPLOYMENT:
            return self.deployment == model
        return True  # tenant (the tenant's rows only are loaded) and platform


class Rule(NamedTuple):
    """A policy with the guard that runs it (governance/guardrails/guards.py)."""

    policy: Policy
    guard: Any


@dataclass(frozen=True)
class Applied:
    """One call's rules, by phase, in a fixed order (mandatory ones first, then by
    policy id); empty phases are empty tuples."""

    pre: tuple[Rule, ...] = ()
    during: tuple[Rule, ...] = ()
    post: tuple[Rule, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.pre or self.during or self.post)


NONE = Applied()


def applied(policies: Iterable[Policy], *, key_id: int | None, model: str,
            build: Callable[[Policy], Any]) -> Applied:
    """The policies a call of `model` (the name asked for) with key `key_id` gets (see
    the module's docstring), each with its guard (`build(policy)`)."""
    chosen: dict[tuple[str, str], Policy] = {}
    best: dict[tuple[str, str], tuple[int, int, int]] = {}
    mandatory: list[Policy] = []
    for policy in policies:
        if not policy.matches(key_id=key_id, model=model):
            continue
        if policy.mandatory and policy.tenant_id is None:
            if policy.enabled:
                mandatory.append(policy)
            continue
        slot = (policy.guard, policy.phase)
        rank = (_RANK[GuardScope(policy.scope)], policy.tenant_id is None, -policy.id)
        if slot not in best or rank < best[slot]:
            best[slot], chosen[slot] = rank, policy
    picked = sorted((p for p in chosen.values() if p.enabled), key=lambda p: p.id)
    ordered = [*sorted(mandatory, key=lambda p: p.id), *picked]
    return Applied(*(tuple(Rule(p, build(p)) for p in ordered if p.phase == phase)
                     for phase in ("pre", "during", "post")))
