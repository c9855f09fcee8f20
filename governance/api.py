"""Management API for governance: rate limits, quotas, prices, circuit breakers, usage.
Handlers only parse, call a selector or service, and serialize."""
# No `from __future__ import annotations` here: ninja resolves the query parameters'
# annotations (dates) at import time.


from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.http import FileResponse, HttpRequest
from ninja import Query, Router, Status
from ninja.pagination import paginate

from governance import billing, live, selectors, services
from governance.exports import export_file
from governance.models import BreakerPolicy, Quota
from governance.schemas import (
    AuditEventOut,
    AuditExportIn,
    AuditExportOut,
    BillingIn,
    BillingOut,
    BreakerFields,
    BreakerOut,
    BudgetCreateIn,
    BudgetDetailOut,
    BudgetFields,
    BudgetOut,
    HttpStatus,
    PriceIn,
    PriceOut,
    QuotaCreateIn,
    QuotaDetailOut,
    QuotaFields,
    QuotaOut,
    RateLimitCreateIn,
    RateLimitDetailOut,
    RateLimitFields,
    RateLimitOut,
    RedactionPatternIn,
    RedactionPatternOut,
    SpendQuery,
    SpendRowOut,
    UsageOut,
)
from sluice.pagination import Pagination
from sluice.schemas import Id
from tenants.api import actor_of

router = Router(tags=["governance"])


# -- rate limits ---------------------------------------------------------------------
@router.get("/governance/rate-limits", response=list[RateLimitOut])
@paginate(Pagination)
def ratelimit_list(request: HttpRequest, tenant_id: Id | None = None):
    return selectors.ratelimit_list(actor=actor_of(request), tenant_id=tenant_id)


@router.post("/governance/rate-limits", response={201: RateLimitOut})
def ratelimit_create(request: HttpRequest, data: RateLimitCreateIn):
    return Status(201, services.ratelimit_create(actor=actor_of(request),
                                                 **data.model_dump(exclude_unset=True)))


@router.get("/governance/rate-limits/{int:policy_id}", response=RateLimitDetailOut)
def ratelimit_get(request: HttpRequest, policy_id: int):
    policy = selectors.ratelimit_get(actor=actor_of(request), policy_id=policy_id)
    return {**RateLimitOut.from_orm(policy).model_dump(),
            "effective": live.effective_rates(policy)}


@router.patch("/governance/rate-limits/{int:policy_id}", response=RateLimitOut)
def ratelimit_update(request: HttpRequest, policy_id: int, data: RateLimitFields):
    return services.ratelimit_update(actor=actor_of(request), policy_id=policy_id,
                                     **data.model_dump(exclude_unset=True))


@router.delete("/governance/rate-limits/{int:policy_id}", response={204: None})
def ratelimit_delete(request: HttpRequest, policy_id: int):
    services.ratelimit_delete(actor=actor_of(request), policy_id=policy_id)
    return Status(204, None)


# -- quotas --------------------------------------------------------------------------
def _quota_detail(quota: Quota) -> dict[str, Any]:
    use = live.quota_use(quota)
    return {**QuotaOut.from_orm(quota).model_dump(), "usage": {
        "requests": use.requests, "tokens": use.tokens,
        "open_reservations": use.open_reservations, "reserved_tokens": use.reserved_tokens,
        "resets_at": datetime.fromtimestamp(use.resets_at, UTC)}}


@router.get("/governance/quotas", response=list[QuotaOut])
@paginate(Pagination)
def quota_list(request: HttpRequest, tenant_id: Id | None = None):
    return selectors.quota_list(actor=actor_of(request), tenant_id=tenant_id)


@router.post("/governance/quotas", response={201: QuotaOut})
def quota_create(request: HttpRequest, data: QuotaCreateIn):
    return Status(201, services.quota_create(actor=actor_of(request),
                                             **data.model_dump(exclude_unset=True)))


@router.get("/governance/quotas/{int:quota_id}", response=QuotaDetailOut)
def quota_get(request: HttpRequest, quota_id: int):
    return _quota_detail(selectors.quota_get(actor=actor_of(request), quota_id=quota_id))


@router.patch("/governance/quotas/{int:quota_id}", response=QuotaOut)
def quota_update(request: HttpRequest, quota_id: int, data: QuotaFields):
    return services.quota_update(actor=actor_of(request), quota_id=quota_id,
                                 **data.model_dump(exclude_unset=True))


@router.delete("/governance/quotas/{int:quota_id}", response={204: None})
def quota_delete(request: HttpRequest, quota_id: int):
    services.quota_delete(actor=actor_of(request), quota_id=quota_id)
    return Status(204, None)


# -- budgets -------------------------------------------------------------------------
@router.get("/governance/budgets", response=list[BudgetOut])
@paginate(Pagination)
def budget_list(request: HttpRequest, tenant_id: Id | None = None):
    return selectors.budget_list(actor=actor_of(request), tenant_id=tenant_id)


@router.post("/governance/budgets", response={201: BudgetOut})
def budget_create(request: HttpRequest, data: BudgetCreateIn):
    return Status(201, services.budget_create(actor=actor_of(request),
                                              **data.model_dump(exclude_unset=True)))


@router.get("/governance/budgets/{int:budget_id}", response=BudgetDetailOut)
def budget_get(request: HttpRequest, budget_id: int):
    budget = selectors.budget_get(actor=actor_of(request), budget_id=budget_id)
    return {**BudgetOut.from_orm(budget).model_dump(), "usage": live.budget_use(budget)}


@router.patch("/governance/budgets/{int:budget_id}", response=BudgetOut)
def budget_update(request: HttpRequest, budget_id: int, data: BudgetFields):
    return services.budget_update(actor=actor_of(request), budget_id=budget_id,
                                  **data.model_dump(exclude_unset=True))


@router.delete("/governance/budgets/{int:budget_id}", response={204: None})
def budget_delete(request: HttpRequest, budget_id: int):
    services.budget_delete(actor=actor_of(request), budget_id=budget_id)
    return Status(204, None)


# -- a tenant's money settings -------------------------------------------------------
@router.get("/tenants/{int:tenant_id}/billing", response=BillingOut)
def billing_get(request: HttpRequest, tenant_id: int):
    return billing.billing_get(actor=actor_of(request), tenant_id=tenant_id)


@router.patch("/tenants/{int:tenant_id}/billing", response=BillingOut)
def billing_update(request: HttpRequest, tenant_id: int, data: BillingIn):
    return billing.billing_update(actor=actor_of(request), tenant_id=tenant_id,
                                  **data.model_dump(exclude_unset=True))


# -- prices --------------------------------------------------------------------------
@router.get("/governance/prices", response=list[PriceOut])
@paginate(Pagination)
def price_list(request: HttpRequest, model: str | None = None):
    return selectors.price_list(actor=actor_of(request), model=model)


@router.post("/governance/prices", response={201: PriceOut})
def price_create(request: HttpRequest, data: PriceIn):
    return Status(201, services.price_create(actor=actor_of(request),
                                             **data.model_dump(exclude_unset=True)))


@router.get("/governance/prices/{int:price_id}", response=PriceOut)
def price_get(request: HttpRequest, price_id: int):
    return selectors.price_get(actor=actor_of(request), price_id=price_id)


@router.delete("/governance/prices/{int:price_id}", response={204: None})
def price_delete(request: HttpRequest, price_id: int):
    services.price_delete(actor=actor_of(request), price_id=price_id)
    return Status(204, None)


# -- breakers ------------------------------------------------------------------------
def _breaker(policy: BreakerPolicy) -> dict[str, Any]:
    fields = {f: getattr(policy, f) for f in services.BREAKER_FIELDS}
    return {**fields, "deployment": policy.deployment.name, "live": live.breaker_state(policy)}


@router.get("/governance/breakers/{name}", response=BreakerOut)
def breaker_get(request: HttpRequest, name: str):
    return _breaker(selectors.breaker_get(actor=actor_of(request), deployment=name))


@router.put("/governance/breakers/{name}", response=BreakerOut)
def breaker_update(request: HttpRequest, name: str, data: BreakerFields):
    return _breaker(services.breaker_update(actor=actor_of(request), deployment=name,
                                            **data.model_dump(exclude_unset=True)))


@router.post("/governance/breakers/{name}/reset", response=BreakerOut)
def breaker_reset(request: HttpRequest, name: str):
    policy = selectors.breaker_get(actor=actor_of(request), deployment=name)
    live.breaker_reset(policy)
    return _breaker(policy)


# -- usage ---------------------------------------------------------------------------
@router.get("/governance/usage", response=list[UsageOut])
@paginate(Pagination)
def usage_list(request: HttpRequest, tenant_id: Id | None = None, model: str | None = None,
               since: date | None = None, until: date | None = None):
    return selectors.usage_list(actor=actor_of(request), tenant_id=tenant_id, model=model,
                                since=since, until=until)


@router.get("/governance/spend", response=list[SpendRowOut])
def spend(request: HttpRequest, query: Query[SpendQuery]):
    until = _aware(query.until) if query.until else datetime.now(UTC)
    since = _aware(query.since) if query.since else until - timedelta(days=30)
    return selectors.spend(actor=actor_of(request), granularity=query.granularity,
                           since=since, until=until, group_by=query.group_by,
                           tenant_id=query.tenant_id, latency=query.latency)


def _aware(at: datetime) -> datetime:
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


# -- audit ---------------------------------------------------------------------------
@router.get("/audit/events", response=list[AuditEventOut])
@paginate(Pagination)
def audit_events(request: HttpRequest, tenant_id: Id | None = None,
                 since: datetime | None = None, until: datetime | None = None,
                 actor: str | None = None, model: str | None = None,
                 status: HttpStatus | None = None, action: str | None = None):
    return selectors.audit_events(actor=actor_of(request), tenant_id=tenant_id, since=since,
                                  until=until, actor_filter=actor, model=model,
                                  status=status, action=action)


@router.post("/audit/exports", response={202: AuditExportOut})
def audit_export_create(request: HttpRequest, data: AuditExportIn):
    fields = data.model_dump(exclude_none=True)
    return Status(202, services.audit_export_create(
        actor=actor_of(request), actor_filter=fields.pop("actor", None), **fields))


@router.get("/audit/exports/{int:export_id}", response=AuditExportOut)
def audit_export_get(request: HttpRequest, export_id: int):
    return selectors.audit_export_get(actor=actor_of(request), export_id=export_id)


@router.get("/audit/exports/{int:export_id}/download")
def audit_export_download(request: HttpRequest, export_id: int) -> FileResponse:
    return export_file(selectors.audit_export_get(actor=actor_of(request),
                                                  export_id=export_id))


# -- redaction patterns ----------------------------------------------------------------
@router.get("/governance/redaction-patterns", response=list[RedactionPatternOut])
@paginate(Pagination)
def redaction_pattern_list(request: HttpRequest):
    return selectors.redaction_patterns(actor=actor_of(request))


@router.post("/governance/redaction-patterns", response={201: RedactionPatternOut})
def redaction_pattern_create(request: HttpRequest, data: RedactionPatternIn):
    return Status(201, services.redaction_pattern_create(actor=actor_of(request),
                                                         label=data.label,
                                                         pattern=data.pattern))


@router.delete("/governance/redaction-patterns/{int:pattern_id}", response={204: None})
def redaction_pattern_delete(request: HttpRequest, pattern_id: int):
    services.redaction_pattern_delete(actor=actor_of(request), pattern_id=pattern_id)
    return Status(204, None)

