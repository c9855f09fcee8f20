"""Writes to governance policies. Every change is validated (422 naming the field),
reaches every gateway within about a second (cache epoch), and, for breaker policies,
hands the memory guard's thresholds to the deployment's workers through Redis.

Who may write: platform admins anything; tenant admins only rate limits of scope
api_key on their own tenant (limits they put on their own keys) and their members' and
keys' budgets (never above a tenant budget of theirs). Every object a write
names (tenant, key, policy, pattern) is looked up through governance.selectors, so one
outside the caller's reach is the same NotFound as a missing one, checked before any
rule that would tell them apart.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from governance import cache, selectors
from governance.audit import record_action
from governance.models import (
    AuditExport,
    BreakerPolicy,
    Budget,
    BudgetScope,
    BudgetWindow,
    Price,
    Quota,
    RateLimitPolicy,
    RateLimitScope,
    RedactionPattern,
)
from governance.ranges import check as check_ranges
from inference.models import Deployment, ModelAlias
from inference.queue import guard_key
from sluice.errors import Conflict, PermissionDenied, Unprocessable
from sluice.pii.safe_patterns import UnsafePattern, compile_tenant_pattern
from sluice.redis import sync_redis
from sluice.validation import validate
from tenants.models import Tenant
from tenants.principal import Principal
from tenants.roles import Action
from tenants.selectors import require

RATELIMIT_FIELDS = ("name", "scope", "model", "requests_per_minute", "tokens_per_minute",
                    "burst_requests", "burst_tokens", "adaptive", "qps_ref", "qps_min",
                    "qps_max", "p99_target_ms", "p99_slope", "floor", "window_s", "fail_open")
QUOTA_FIELDS = ("model", "period", "window", "max_requests", "max_tokens", "max_concurrent",
                "shadow")
PRICE_FIELDS = ("model", "input_per_mtok_usd", "output_per_mtok_usd",
                "cached_input_per_mtok_usd", "gpu_second_usd", "valid_from")
BREAKER_FIELDS = ("window_kind", "window_size", "min_calls", "failure_rate", "slow_call_ms",
                  "slow_call_rate", "open_wait_s", "half_open_probes", "probe_timeout_s",
                  "memory_high", "memory_low", "memory_hold_s", "degrade_mode",
                  "degraded_max_tokens", "shed_queue_depth", "shed_oldest_age_ms",
                  "priority_share")


def _may_write_limit(actor: Principal, policy: RateLimitPolicy) -> None:
    if actor.can(Action.GOVERNANCE_MANAGE_ANY):
        return
    require(actor, Action.GOVERNANCE_MANAGE)
    if policy.tenant_id != actor.tenant_id or policy.scope != RateLimitScope.API_KEY:
        raise PermissionDenied("Tenant admins may only set limits on their own API keys; "
                               "tenant and model limits are set by platform admins.")


def _save(actor: Principal | None, row: Any, action: str, kind: str,
          detail: dict[str, Any] | None = None, *, target: str | None = None,
          exclude: list[str] | None = None) -> None:
    """Every policy write ends the same way: validated (422), saved, the gateways'
    caches told, the admin action audited (target "<kind>:<id>" unless given)."""
    validate(row, exclude=exclude)
    check_ranges(row)  # the documented ranges, whatever the edge (API, UI)
    row.save()
    cache.invalidate()
    record_action(actor=actor, action=action, target=target or f"{kind}:{row.pk}",
                  detail=detail)


def _apply(row: Any, fields: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for key, value in fields.items():
        if key in allowed:
            if value is None and not row._meta.get_field(key).null:
                # An explicit null for a field that always has a value: the caller's
                # mistake (a 422), not a NOT NULL violation in the database (a 500).
                raise Unprocessable(f"'{key}' may not be null; leave it out to keep the "
                                    "default.", param=key, code="null_value")
            setattr(row, key, value)


@transaction.atomic
def ratelimit_create(*, actor: Principal, tenant_id: int | None = None,
                     api_key_id: int | None = None, **fields: Any) -> RateLimitPolicy:
    require(actor, Action.GOVERNANCE_MANAGE, Action.GOVERNANCE_MANAGE_ANY)
    if not actor.can(Action.GOVERNANCE_MANAGE_ANY):
        tenant_id = actor.tenant_id if tenant_id is None else tenant_id
    policy = RateLimitPolicy(tenant=None if tenant_id is None else
                             selectors.governed_tenant(actor=actor, tenant_id=tenant_id))
    if api_key_id is not None:
        if tenant_id is None:
            raise Unprocessable("api_key_id needs the key's tenant_id.", param="tenant_id")
        policy.api_key = selectors.governed_key(actor=actor, tenant_id=tenant_id,
                                                key_id=api_key_id)
    _apply(policy, fields, RATELIMIT_FIELDS)
    _may_write_limit(actor, policy)
    _save(actor, policy, "ratelimit.create", "ratelimit")
    return policy


@transaction.atomic
def ratelimit_update(*, actor: Principal, policy_id: int, **fields: Any) -> RateLimitPolicy:
    policy = selectors.ratelimit_get(actor=actor, policy_id=policy_id)
    _may_write_limit(actor, policy)
    _apply(policy, fields, tuple(f for f in RATELIMIT_FIELDS if f != "scope"))
    _save(actor, policy, "ratelimit.update", "ratelimit", fields)
    return policy


@transaction.atomic
def ratelimit_delete(*, actor: Principal, policy_id: int) -> None:
    policy = selectors.ratelimit_get(actor=actor, policy_id=policy_id)
    _may_write_limit(actor, policy)
    record_action(actor=actor, action="ratelimit.delete", target=f"ratelimit:{policy.pk}")
    policy.delete()
    cache.invalidate()


@transaction.atomic
def quota_create(*, actor: Principal, tenant_id: int, **fields: Any) -> Quota:
    require(actor, Action.GOVERNANCE_MANAGE_ANY)
    quota = Quota(tenant=selectors.governed_tenant(actor=actor, tenant_id=tenant_id))
    _apply(quota, fields, QUOTA_FIELDS)
    _save(actor, quota, "quota.create", "quota", fields)
    return quota


@transaction.atomic
def quota_update(*, actor: Principal, quota_id: int, **fields: Any) -> Quota:
    require(actor, Action.GOVERNANCE_MANAGE_ANY)
    quota = selectors.quota_get(actor=actor, quota_id=quota_id)
    # The period and window shape the Redis counters: changing them starts afresh.
    _apply(quota, fields, QUOTA_FIELDS)
    _save(actor, quota, "quota.update", "quota", fields)
    return quota


@transaction.atomic
def quota_delete(*, actor: Principal, quota_id: int) -> None:
    require(actor, Action.GOVERNANCE_MANAGE_ANY)
    selectors.quota_get(actor=actor, quota_id=quota_id).delete()
    cache.invalidate()
    record_action(actor=actor, action="quota.delete", target=f"quota:{quota_id}")


def _price_detail(row: Price) -> dict[str, Any]:
    return {f: None if (v := getattr(row, f)) is None else str(v) for f in PRICE_FIELDS}


@transaction.atomic
def price_create(*, actor: Principal | None, **fields: Any) -> Price:
    """A price version. Versions are never edited: a new price is a new version from its
    `valid_from` (default now), so every past call re-prices the same way. `actor` None:
    the operator at the command line (manage.py importprices), audited as "system"."""
    if actor is not None:
        require(actor, Action.GOVERNANCE_MANAGE_ANY)
    price = Price()
    _apply(price, {k: v for k, v in fields.items() if v is not None or k != "valid_from"},
           PRICE_FIELDS)
    taken = Conflict(f"'{price.model}' has a price from that valid_from already; a "
                     "version is never edited: add one from another time.",
                     param="valid_from")
    if Price.objects.filter(model=price.model, valid_from=price.valid_from).exists():
        raise taken
    try:
        with transaction.atomic():  # two at once: the database's constraint decides
            _save(actor, price, "price.create", "price", _price_detail(price))
    except IntegrityError:
        raise taken from None
    return price


@transaction.atomic
def price_delete(*, actor: Principal, price_id: int) -> None:
    require(actor, Action.GOVERNANCE_MANAGE_ANY)
    price = selectors.price_get(actor=actor, price_id=price_id)
    record_action(actor=actor, action="price.delete", target=f"price:{price_id}",
                  detail=_price_detail(price))
    price.delete()
    cache.invalidate()


@transaction.atomic
def budget_create(*, actor: Principal, tenant_id: int | None = None,
                  scope: str = BudgetScope.TENANT, member_id: int | None = None,
                  key_id: int | None = None, **fields: Any) -> Budget:
    """A spend budget. Platform admins set tenant budgets; tenant admins set their
    members' and keys' budgets, each at most the tenant's budget of the same window
    (of the same model, or of all models)."""
    require(actor, Action.GOVERNANCE_MANAGE, Action.GOVERNANCE_MANAGE_ANY)
    tenant = selectors.governed_tenant(
        actor=actor, tenant_id=actor.tenant_id if tenant_id is None else tenant_id)
    budget = Budget(tenant=tenant, scope=scope)
    if member_id is not None:
        budget.member = selectors.governed_member(actor=actor, tenant_id=tenant.pk,
                                                  member_id=member_id)
    if key_id is not None:
        budget.api_key = selectors.governed_key(actor=actor, tenant_id=tenant.pk,
                                                key_id=key_id, param="key_id")
    if scope == BudgetScope.TENANT and not actor.can(Action.GOVERNANCE_MANAGE_ANY):
        raise PermissionDenied("Tenant budgets are set by platform admins; tenant admins "
                               "set their members' and keys' budgets.")
    _apply(budget, fields, ("model", "window", "limit_usd", "alert_at", "fallback_model"))
    _below_the_tenants(budget)
    _known_fallback(budget)
    _save(actor, budget, "budget.create", "budget", _budget_detail(budget))
    return budget


@transaction.atomic
def budget_update(*, actor: Principal, budget_id: int, **fields: Any) -> Budget:
    budget = selectors.budget_get(actor=actor, budget_id=budget_id)
    _may_write_budget(actor, budget)
    _apply(budget, fields, ("limit_usd", "alert_at", "fallback_model"))
    _below_the_tenants(budget)
    _known_fallback(budget)
    _save(actor, budget, "budget.update", "budget", _budget_detail(budget))
    return budget


@transaction.atomic
def budget_delete(*, actor: Principal, budget_id: int) -> None:
    budget = selectors.budget_get(actor=actor, budget_id=budget_id)
    _may_write_budget(actor, budget)
    record_action(actor=actor, action="budget.delete", target=f"budget:{budget_id}",
                  detail=_budget_detail(budget))
    budget.delete()
    cache.invalidate()


def _may_write_budget(actor: Principal, budget: Budget) -> None:
    require(actor, Action.GOVERNANCE_MANAGE, Action.GOVERNANCE_MANAGE_ANY)  # auditors read
    if budget.scope == BudgetScope.TENANT and not actor.can(Action.GOVERNANCE_MANAGE_ANY):
        raise PermissionDenied("Tenant budgets are set by platform admins.")


def _below_the_tenants(budget: Budget) -> None:
    """A member's or key's budget may not exceed a tenant budget of the same window that
    covers its model: 422 naming limit_usd."""
    if budget.scope == BudgetScope.TENANT or budget.limit_usd is None:
        return
    ceiling = Budget.objects.filter(tenant=budget.tenant, scope=BudgetScope.TENANT,
                                    window=budget.window, model__in=("", budget.model),
                                    limit_usd__lt=budget.limit_usd).first()
    if ceiling is not None:
        raise Unprocessable(f"limit_usd: above the tenant's {budget.window} budget "
                            f"(${ceiling.limit_usd.normalize():f}).", param="limit_usd")


def _known_fallback(budget: Budget) -> None:
    """A fallback names a deployment or alias other than the budget's own model."""
    name = budget.fallback_model
    if not name:
        return
    if name == budget.model or not (Deployment.objects.filter(name=name).exists()
                                    or ModelAlias.objects.filter(name=name).exists()):
        raise Unprocessable("fallback_model: name another model or alias that exists.",
                            param="fallback_model")


def _budget_detail(budget: Budget) -> dict[str, Any]:
    return {"scope": budget.scope, "member_id": budget.member_id,
            "key_id": budget.api_key_id, "model": budget.model, "window": budget.window,
            "limit_usd": str(budget.limit_usd),
            "alert_at": ",".join(str(p) for p in budget.alert_at or ()),
            "fallback_model": budget.fallback_model}


@transaction.atomic
def breaker_update(*, actor: Principal, deployment: str, **fields: Any) -> BreakerPolicy:
    require(actor, Action.GOVERNANCE_MANAGE_ANY)
    policy = selectors.breaker_get(actor=actor, deployment=deployment)
    _apply(policy, fields, BREAKER_FIELDS)
    policy.updated_at = timezone.now()
    _save(actor, policy, "breaker.update", "deployment", fields,
          target=f"deployment:{deployment}", exclude=["deployment"])
    transaction.on_commit(lambda: publish_guard(policy))
    return policy


def publish_guards() -> None:
    """Every deployment's thresholds to Redis (the run command, after a Redis restart)."""
    for policy in BreakerPolicy.objects.select_related("deployment"):
        publish_guard(policy)


def publish_guard(policy: BreakerPolicy) -> None:
    """Hand the memory guard's thresholds to the deployment's workers."""
    sync_redis().hset(guard_key(policy.deployment.name), mapping={
        "high": repr(policy.memory_high), "low": repr(policy.memory_low),
        "hold_s": repr(policy.memory_hold_s)})


@transaction.atomic
def audit_export_create(*, actor: Principal, format: str, tenant_id: int | None = None,
                        actor_filter: str | None = None, **filters: Any) -> AuditExport:
    """Queue an export of the events the caller may read (`actor_filter`: only that
    principal's events; `tenant_id`: a tenant the caller may read, else NotFound; none:
    every tenant for platform admins, their own for the others); the Celery job starts
    on commit."""
    require(actor, Action.AUDIT_READ)
    if actor_filter:
        filters["actor"] = actor_filter
    if tenant_id is not None:
        tenant_id = selectors.governed_tenant(actor=actor, tenant_id=tenant_id).pk
    elif not actor.can(Action.TENANT_READ_ANY):
        tenant_id = actor.tenant_id
    clean = {k: (v.isoformat() if hasattr(v, "isoformat") else v)
             for k, v in filters.items() if v is not None}
    export = AuditExport.objects.create(tenant_id=tenant_id, requested_by=actor.subject,
                                        format=format, filters=clean)
    record_action(actor=actor, action="audit.export", target=f"export:{export.pk}",
                  detail=clean)
    from governance.tasks import audit_export

    transaction.on_commit(lambda: audit_export.delay(export.pk))
    return export


@transaction.atomic
def redaction_pattern_create(*, actor: Principal, label: str,
                             pattern: str) -> RedactionPattern:
    """A tenant admin's own pattern; refused (422) unless safe to run on any input."""
    require(actor, Action.GOVERNANCE_MANAGE)
    try:
        compile_tenant_pattern(pattern)
    except UnsafePattern as exc:
        raise Unprocessable(f"pattern: {exc}", param="pattern") from None
    row = RedactionPattern(tenant_id=actor.tenant_id, label=label, pattern=pattern)
    _save(actor, row, "redaction.create", "pattern", {"label": label})
    return row


@transaction.atomic
def redaction_pattern_delete(*, actor: Principal, pattern_id: int) -> None:
    selectors.redaction_pattern_get(actor=actor, pattern_id=pattern_id).delete()
    cache.invalidate()
    record_action(actor=actor, action="redaction.delete", target=f"pattern:{pattern_id}")


# Illustrative prices of the seeded models (US dollars per million tokens), so that a
# newcomer's first calls show what they cost; an operator replaces them.
DEMO_PRICES = {"smollm2-135m-instruct": ("0.10", "0.20"), "all-minilm-l6-v2": ("0.02", "0"),
               "echo": ("0.01", "0.01")}
DEMO_BUDGET_USD = Decimal("10")


@transaction.atomic
def demo_money_seed(*, tenant_slug: str = "demo") -> Budget:
    """Idempotent: the seeded models have prices from 2026-01-01 (UTC) and the demo
    tenant a monthly budget of DEMO_BUDGET_USD (the run command's first minute)."""
    since = datetime(2026, 1, 1, tzinfo=UTC)
    for model, (given, made) in DEMO_PRICES.items():
        Price.objects.get_or_create(model=model, valid_from=since, defaults={
            "input_per_mtok_usd": Decimal(given), "output_per_mtok_usd": Decimal(made)})
    budget, _ = Budget.objects.get_or_create(
        tenant=Tenant.objects.get(slug=tenant_slug), scope=BudgetScope.TENANT, model="",
        window=BudgetWindow.MONTH, defaults={"limit_usd": DEMO_BUDGET_USD})
    cache.invalidate()
    return budget
