"""Governance policies for the hot path, cached in-process.

A tenant's rate limits (its own and the platform defaults) and quotas, each
deployment's breaker policy and each model's prices are read once per
SLUICE_POLICY_CACHE_TTL_S (default 5 s); an edit bumps an epoch in Redis on commit, and
every gateway process drops its cache within about a second of that. Rows are read
through governance.ranges.sane: a stored number out of its documented range is clamped,
never trusted by the hot path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from governance import pricing
from governance.breaker import default_policy
from governance.guardrail_models import GuardrailPolicy
from governance.guardrails.guards import Broken, guard_of
from governance.guardrails.policy import Applied, Policy, applied
from governance.models import (
    BreakerPolicy,
    Budget,
    BudgetScope,
    Quota,
    RateLimitPolicy,
    RateLimitScope,
    RedactionPattern,
)
from governance.ranges import sane
from inference.models import Deployment
from sluice.db import async_db
from sluice.epoch import Epoch
from sluice.pii.safe_patterns import UnsafePattern, compile_tenant_pattern
from sluice.ttlcache import AsyncTTLCache

EPOCH_KEY = "sluice:gov:epoch"


@dataclass(frozen=True)
class TenantPolicies:
    rate_limits: tuple[RateLimitPolicy, ...]
    quotas: tuple[Quota, ...]
    budgets: tuple[Budget, ...] = ()
    # the tenant's own redaction patterns, compiled (label, pattern)
    redaction: tuple[tuple[str, re.Pattern[str]], ...] = ()
    # the tenant's guardrail policies and the platform's (governance/guardrails/policy.py)
    guardrails: tuple[Policy, ...] = ()
    # limits_for's answers: the policies never change (a change replaces this object).
    _limits: dict[tuple[int | None, str], list[tuple[RateLimitPolicy, str]]] = field(
        default_factory=dict, compare=False, repr=False)
    _guards: dict[tuple[int | None, str], Applied] = field(
        default_factory=dict, compare=False, repr=False)
    _built: dict[int, Any] = field(default_factory=dict, compare=False, repr=False)

    def limits_for(self, *, key_id: int | None, model: str
                   ) -> list[tuple[RateLimitPolicy, str]]:
        """The one policy per scope that applies, with the subject its buckets count:
        the most specific wins (a tenant's own over the default; a named key or model
        over "each key" / "each model"). Worked out once per key and model."""
        known = self._limits.get((key_id, model))
        if known is None:
            known = self._limits[(key_id, model)] = self._choose(key_id, model)
        return known

    def _choose(self, key_id: int | None, model: str) -> list[tuple[RateLimitPolicy, str]]:
        out: list[tuple[RateLimitPolicy, str]] = []

        def best(candidates: list[tuple[int, RateLimitPolicy]]) -> RateLimitPolicy | None:
            return min(candidates, key=lambda c: (c[0], c[1].pk))[1] if candidates else None

        tenant = best([(p.tenant_id is None, p) for p in self.rate_limits
                       if p.scope == RateLimitScope.TENANT])
        if tenant is not None:
            out.append((tenant, "t"))
        if key_id is not None:
            keyed = best([(2 * (p.tenant_id is None) + (p.api_key_id is None), p)
                          for p in self.rate_limits if p.scope == RateLimitScope.API_KEY
                          and p.api_key_id in (None, key_id)])
            if keyed is not None:
                out.append((keyed, f"k{key_id}"))
        per_model = best([(2 * (p.tenant_id is None) + (not p.model), p)
                          for p in self.rate_limits if p.scope == RateLimitScope.MODEL
                          and p.model in ("", model)])
        if per_model is not None:
            out.append((per_model, f"m:{model}"))
        return out

    def quotas_for(self, model: str) -> list[Quota]:
        return [q for q in self.quotas if q.model in ("", model)]

    def budgets_for(self, *, member_id: int | None, key_id: int | None,
                    model: str) -> list[Budget]:
        """The tenant's budgets a call of `model` by this member or key spends from."""
        return [b for b in self.budgets if b.model in ("", model) and (
            b.scope == BudgetScope.TENANT
            or (b.scope == BudgetScope.MEMBER and member_id is not None
                and b.member_id == member_id)
            or (b.scope == BudgetScope.KEY and key_id is not None and b.api_key_id == key_id))]

    def guardrails_for(self, *, key_id: int | None, model: str) -> Applied:
        """The guardrail policies of a call of `model` (the name asked for) by key
        `key_id`, worked out once per key and model."""
        known = self._guards.get((key_id, model))
        if known is None:
            known = self._guards[(key_id, model)] = applied(
                self.guardrails, key_id=key_id, model=model, build=self._guard)
        return known

    def _guard(self, policy: Policy) -> Any:
        guard = self._built.get(policy.id)
        if guard is None:
            try:
                guard = guard_of(policy, self.redaction)
            except Exception as exc:  # a row that no longer builds: its on_error decides
                guard = Broken(f"{type(exc).__name__}: {exc}")
            self._built[policy.id] = guard
        return guard


_tenants: AsyncTTLCache[int, TenantPolicies] = AsyncTTLCache(max_entries=100_000)
_breakers: AsyncTTLCache[str, BreakerPolicy] = AsyncTTLCache(max_entries=10_000)
_prices: AsyncTTLCache[str, pricing.Versions] = AsyncTTLCache(max_entries=10_000)
_epoch = Epoch(EPOCH_KEY)


def load_tenant(tenant_id: int) -> TenantPolicies:
    limits = RateLimitPolicy.objects.filter(Q(tenant_id=tenant_id) | Q(tenant__isnull=True))
    patterns = []
    for row in RedactionPattern.objects.filter(tenant_id=tenant_id):
        try:
            patterns.append((row.label, compile_tenant_pattern(row.pattern)))
        except UnsafePattern:  # checked on save; never run one that fails now
            continue
    return TenantPolicies(rate_limits=tuple(sane(p) for p in limits), quotas=tuple(
        sane(q) for q in Quota.objects.filter(tenant_id=tenant_id)), redaction=tuple(patterns),
        # with its tenant: the windows follow the tenant's time zone (quota.shape_args)
        budgets=tuple(Budget.objects.filter(tenant_id=tenant_id).select_related("tenant")),
        guardrails=tuple(Policy.of(row) for row in GuardrailPolicy.objects.filter(
            Q(tenant_id=tenant_id) | Q(tenant__isnull=True))))


def load_breaker(deployment: str) -> BreakerPolicy:
    row = BreakerPolicy.objects.filter(deployment__name=deployment).first()
    if row is not None:
        return sane(row)
    dep = Deployment.objects.filter(name=deployment).only("pk").first()
    return default_policy(dep.pk if dep is not None else 0)


async def _fresh() -> None:
    if await _epoch.moved():
        _tenants.clear()
        _breakers.clear()
        _prices.clear()


async def tenant_policies(tenant_id: int) -> TenantPolicies:
    await _fresh()
    return await _tenants.get(tenant_id, lambda: async_db(load_tenant)(tenant_id),
                              float(settings.SLUICE_POLICY_CACHE_TTL_S))


async def breaker_policy(deployment: str) -> BreakerPolicy:
    await _fresh()
    return await _breakers.get(deployment, lambda: async_db(load_breaker)(deployment),
                               float(settings.SLUICE_POLICY_CACHE_TTL_S))


async def price_versions(model: str) -> pricing.Versions:
    """`model`'s price versions (none: its calls are not priced)."""
    await _fresh()
    return await _prices.get(model, lambda: async_db(pricing.versions)(model),
                             float(settings.SLUICE_POLICY_CACHE_TTL_S))


def invalidate() -> None:
    """Call from a service that changed a policy; takes effect on commit."""
    _epoch.bump_on_commit()
    transaction.on_commit(clear)


def clear() -> None:
    _tenants.clear()
    _breakers.clear()
    _prices.clear()
    _epoch.reset()
