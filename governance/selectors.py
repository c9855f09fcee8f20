"""Reads of governance policies and usage, scoped by the caller.

Platform admins (governance.manage_any) see everything; tenant admins
(governance.manage) see their tenant's policies, the platform defaults that apply to it,
and its usage; auditors see usage. Every lookup by id, here and in the services, goes
through a selector of this module or tenants.selectors: an object outside the caller's
reach is NotFound with the same message as a missing one, so answers never tell another
tenant's ids from free ones.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta
from typing import Any

from django.db.models import Q, QuerySet

from governance import rollups
from governance.models import (
    AuditEvent,
    AuditExport,
    BreakerPolicy,
    Budget,
    Price,
    Quota,
    RateLimitPolicy,
    RedactionPattern,
    UsageRecord,
)
from inference.models import Deployment
from sluice.errors import NotFound, Unprocessable
from tenants import selectors as tenant_selectors
from tenants.models import ApiKey, Member, Tenant
from tenants.principal import Principal
from tenants.roles import Action
from tenants.selectors import require


def _any(actor: Principal) -> bool:
    return actor.can(Action.GOVERNANCE_MANAGE_ANY)


def governed_tenants(*, actor: Principal) -> QuerySet[Tenant]:
    """The tenants whose policies the caller may name (a form's choices): every tenant
    for platform admins, their own for anyone else."""
    if actor.can(Action.TENANT_READ_ANY):
        return tenant_selectors.tenant_list(actor=actor).order_by("slug")
    return Tenant.objects.filter(pk=actor.tenant_id)


def governed_tenant(*, actor: Principal, tenant_id: int) -> Tenant:
    """A tenant named in a policy or an export: NotFound (param tenant_id) for one
    missing or outside `governed_tenants`, the same answer for both."""
    tenant = governed_tenants(actor=actor).filter(pk=tenant_id).first()
    if tenant is None:
        raise NotFound("No such tenant.", param="tenant_id")
    return tenant


def governed_key(*, actor: Principal, tenant_id: int, key_id: int,
                 param: str = "api_key_id") -> ApiKey:
    """An API key of a governed tenant that a limit or a budget may name: NotFound
    (naming `param`, the caller's field) for a key missing or in another tenant."""
    tenant = governed_tenant(actor=actor, tenant_id=tenant_id)
    key = ApiKey.objects.filter(pk=key_id, tenant=tenant).first()
    if key is None:
        raise NotFound("No such API key in that tenant.", param=param)
    return key


def ratelimit_list(*, actor: Principal, tenant_id: int | None = None
                   ) -> QuerySet[RateLimitPolicy]:
    require(actor, Action.GOVERNANCE_MANAGE, Action.GOVERNANCE_MANAGE_ANY)
    rows = RateLimitPolicy.objects.select_related("api_key").order_by("id")
    if not _any(actor):
        rows = rows.filter(Q(tenant_id=actor.tenant_id) | Q(tenant__isnull=True))
    if tenant_id is not None:
        rows = rows.filter(tenant_id=tenant_id)
    return rows


def ratelimit_get(*, actor: Principal, policy_id: int) -> RateLimitPolicy:
    row = ratelimit_list(actor=actor).filter(pk=policy_id).first()
    if row is None:
        raise NotFound("No such rate limit.")
    return row


def quota_list(*, actor: Principal, tenant_id: int | None = None) -> QuerySet[Quota]:
    require(actor, Action.GOVERNANCE_MANAGE, Action.GOVERNANCE_MANAGE_ANY)
    rows = Quota.objects.select_related("tenant").order_by("id")
    if not _any(actor):
        rows = rows.filter(tenant_id=actor.tenant_id)
    if tenant_id is not None:
        rows = rows.filter(tenant_id=tenant_id)
    return rows


def quota_get(*, actor: Principal, quota_id: int) -> Quota:
    row = quota_list(actor=actor).filter(pk=quota_id).first()
    if row is None:
        raise NotFound("No such quota.")
    return row


def price_list(*, actor: Principal, model: str | None = None) -> QuerySet[Price]:
    """Every price version (newest first per model): what a call costs is no secret
    from anyone who may list the models."""
    require(actor, Action.MODEL_LIST)
    rows = Price.objects.all()
    return rows if model is None else rows.filter(model=model)


def price_get(*, actor: Principal, price_id: int) -> Price:
    row = price_list(actor=actor).filter(pk=price_id).first()
    if row is None:
        raise NotFound("No such price.")
    return row


def governed_member(*, actor: Principal, tenant_id: int, member_id: int) -> Member:
    """A member of a governed tenant that a budget may name: NotFound (param member_id)
    for one missing or in another tenant."""
    tenant = governed_tenant(actor=actor, tenant_id=tenant_id)
    member = Member.objects.filter(pk=member_id, tenant=tenant).first()
    if member is None:
        raise NotFound("No such member in that tenant.", param="member_id")
    return member


def budget_list(*, actor: Principal, tenant_id: int | None = None) -> QuerySet[Budget]:
    """The budgets the caller may see: their tenant's (tenant admins and auditors), or
    every tenant's (platform admins)."""
    require(actor, Action.GOVERNANCE_MANAGE, Action.GOVERNANCE_MANAGE_ANY, Action.AUDIT_READ)
    rows = Budget.objects.select_related("tenant").order_by("id")
    if not _any(actor):
        rows = rows.filter(tenant_id=actor.tenant_id)
    if tenant_id is not None:
        rows = rows.filter(tenant_id=tenant_id)
    return rows


def budget_get(*, actor: Principal, budget_id: int) -> Budget:
    row = budget_list(actor=actor).filter(pk=budget_id).first()
    if row is None:
        raise NotFound("No such budget.")
    return row


def breaker_get(*, actor: Principal, deployment: str) -> BreakerPolicy:
    """The deployment's policy (its defaults, unsaved, when it has no row yet)."""
    require(actor, Action.GOVERNANCE_MANAGE_ANY)
    dep = Deployment.objects.filter(name=deployment).first()
    if dep is None:
        raise NotFound(f"No deployment named '{deployment}'.")
    row = BreakerPolicy.objects.filter(deployment=dep).first()
    return row if row is not None else BreakerPolicy(deployment=dep)


def usage_list(*, actor: Principal, tenant_id: int | None = None, model: str | None = None,
               since: date | None = None, until: date | None = None
               ) -> QuerySet[UsageRecord]:
    require(actor, Action.GOVERNANCE_MANAGE, Action.GOVERNANCE_MANAGE_ANY, Action.AUDIT_READ)
    rows = UsageRecord.objects.select_related("tenant").order_by("-day", "tenant_id", "model",
                                                                 "key_prefix")
    if not _any(actor):
        rows = rows.filter(tenant_id=actor.tenant_id)
    if tenant_id is not None:
        rows = rows.filter(tenant_id=tenant_id)
    if model:
        rows = rows.filter(model=model)
    if since is not None:
        rows = rows.filter(day__gte=since)
    if until is not None:
        rows = rows.filter(day__lte=until)
    return rows


SPEND_MAX_HOURS, SPEND_MAX_DAYS = 24 * 31, 400  # the longest range per granularity


def spend(*, actor: Principal, granularity: str, since: datetime, until: datetime,
          group_by: str | None = None, tenant_id: int | None = None,
          latency: bool = False, per_period: bool = True) -> list[dict[str, Any]]:
    """The spend history (governance/rollups.py) of the caller's tenant (platform admins:
    `tenant_id`'s, default their own). Tenant admins and auditors see all of it,
    developers the calls of their keys (theirs, or made by them). Another tenant is
    NotFound."""
    require(actor, Action.GOVERNANCE_MANAGE, Action.AUDIT_READ, Action.APIKEY_MANAGE_OWN)
    tenant = actor.tenant_id if tenant_id is None else tenant_id
    if tenant != actor.tenant_id and not (_any(actor)
                                          and Tenant.objects.filter(pk=tenant).exists()):
        raise NotFound("No such tenant.")
    if until <= since:
        raise Unprocessable("to: after from.", param="to")
    longest = (timedelta(hours=SPEND_MAX_HOURS) if granularity == rollups.HOUR
               else timedelta(days=SPEND_MAX_DAYS))
    if until - since > longest:
        raise Unprocessable(f"from/to: at most {longest.days} days per {granularity}.",
                            param="from")
    prefixes = None
    if not (actor.can(Action.GOVERNANCE_MANAGE) or actor.can(Action.AUDIT_READ)):
        mine = Q(created_by=actor.subject)
        if actor.member_id is not None:
            mine |= Q(member_id=actor.member_id)
        prefixes = list(ApiKey.objects.filter(mine, tenant_id=actor.tenant_id)
                        .values_list("prefix", flat=True))
    return rollups.spend(tenant_id=tenant, granularity=granularity, start=since, stop=until,
                         group_by=group_by, key_prefixes=prefixes, latency=latency,
                         per_period=per_period)


def own_usage(*, actor: Principal) -> QuerySet[UsageRecord]:
    """Usage of the API keys the caller created (what a developer may see of usage)."""
    require(actor, Action.APIKEY_MANAGE_OWN)
    prefixes = ApiKey.objects.filter(tenant_id=actor.tenant_id,
                                     created_by=actor.subject).values("prefix")
    return UsageRecord.objects.filter(tenant_id=actor.tenant_id, key_prefix__in=prefixes)


def filter_events(rows: QuerySet[AuditEvent], *, tenant_id: int | None = None,
                  since: str | datetime | None = None, until: str | datetime | None = None,
                  actor: str | None = None, model: str | None = None,
                  status: int | None = None, action: str | None = None
                  ) -> QuerySet[AuditEvent]:
    """The auditor's filters (also stored on exports, hence strings for times)."""
    if tenant_id is not None:
        rows = rows.filter(tenant_id=tenant_id)
    if since:
        rows = rows.filter(at__gte=since)
    if until:
        rows = rows.filter(at__lt=until)
    if actor:
        rows = rows.filter(actor=actor)
    if model:
        rows = rows.filter(model=model)
    if status is not None:
        rows = rows.filter(status=status)
    if action:
        rows = rows.filter(action=action)
    return rows


def _audit_scope(actor: Principal, tenant_id: int | None) -> int | None:
    require(actor, Action.AUDIT_READ)
    if actor.can(Action.TENANT_READ_ANY):
        return tenant_id
    return actor.tenant_id


def audit_events(*, actor: Principal, tenant_id: int | None = None,
                 actor_filter: str | None = None, **filters: Any) -> QuerySet[AuditEvent]:
    """Audit events the caller may read: platform admins any tenant's, the others their
    own tenant's; newest first. `actor_filter`: only events of that principal."""
    scope = _audit_scope(actor, tenant_id)
    return filter_events(AuditEvent.objects.all(), tenant_id=scope, actor=actor_filter,
                         **filters).order_by("-at", "-id")


def audit_event_get(*, actor: Principal, event_id: int) -> AuditEvent:
    event = audit_events(actor=actor).filter(pk=event_id).first()
    if event is None:
        raise NotFound("No such event.")
    return event


def audit_export_get(*, actor: Principal, export_id: int) -> AuditExport:
    require(actor, Action.AUDIT_READ)
    rows = AuditExport.objects.filter(pk=export_id)
    if not actor.can(Action.TENANT_READ_ANY):
        rows = rows.filter(tenant_id=actor.tenant_id)
    export = rows.first()
    if export is None:
        raise NotFound("No such export.")
    return export


def redaction_patterns(*, actor: Principal) -> QuerySet[RedactionPattern]:
    require(actor, Action.GOVERNANCE_MANAGE)
    return RedactionPattern.objects.filter(tenant_id=actor.tenant_id).order_by("id")


def redaction_pattern_get(*, actor: Principal, pattern_id: int) -> RedactionPattern:
    row = redaction_patterns(actor=actor).filter(pk=pattern_id).first()
    if row is None:
        raise NotFound("No such redaction pattern.")
    return row

