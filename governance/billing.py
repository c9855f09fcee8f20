"""A tenant's money settings: the time zone its budgets' calendar windows follow, and the
webhook its budget alerts are POSTed to (governance/alerts.py).

Who: anyone of the tenant with governance rights reads them (platform admins, every
tenant's); tenant admins set their tenant's webhook; only platform admins move a time
zone, because moving it moves every window's bounds (a day's spend is read against the
new day). The webhook's secret is sealed at rest like an upstream key and write-only:
Sluice makes one when none is given and returns it once, in the reply that set it.
Audited as `tenant.billing`; gateways see a new time zone within a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from django.db import transaction
from django.utils import timezone

from governance import cache
from governance.alerts import signing_secret
from governance.audit import record_action
from governance.models import AlertWebhook
from inference.upstream.urls import UpstreamURLError, validate_url
from sluice.errors import PermissionDenied, Unprocessable
from tenants.models import Tenant
from tenants.principal import Principal
from tenants.roles import Action
from tenants.selectors import require, tenant_get


@dataclass(frozen=True)
class Billing:
    tenant_id: int
    time_zone: str
    webhook_url: str | None
    webhook_secret_hint: str | None
    webhook_secret: str | None = None  # only in the reply that set it


def billing_get(*, actor: Principal, tenant_id: int) -> Billing:
    require(actor, Action.GOVERNANCE_MANAGE)
    return _billing(tenant_get(actor=actor, tenant_id=tenant_id))


@transaction.atomic
def billing_update(*, actor: Principal, tenant_id: int, **given: Any) -> Billing:
    """Change what `given` names: `time_zone` (an IANA name; platform admins),
    `webhook_url` (None removes the webhook) and `webhook_secret` (default: a new one
    when the URL is first set)."""
    require(actor, Action.GOVERNANCE_MANAGE)
    tenant = Tenant.objects.select_for_update().get(
        pk=tenant_get(actor=actor, tenant_id=tenant_id).pk)
    detail: dict[str, Any] = {}
    if "time_zone" in given and given["time_zone"] != tenant.time_zone:
        if not actor.can(Action.GOVERNANCE_MANAGE_ANY):
            raise PermissionDenied("A tenant's time zone is set by platform admins.")
        tenant.time_zone = _zone(given["time_zone"])
        tenant.save(update_fields=["time_zone"])
        detail["time_zone"] = tenant.time_zone
        cache.invalidate()
    made = None
    hook = AlertWebhook.objects.filter(tenant=tenant).first()
    if "webhook_url" in given and given["webhook_url"] is None:
        if hook is not None:
            hook.delete()
            hook = None
        detail["webhook_url"] = None
    elif "webhook_url" in given or "webhook_secret" in given:
        if hook is None and "webhook_url" not in given:
            raise Unprocessable("webhook_secret: set webhook_url first.", param="webhook_secret")
        hook = hook or AlertWebhook(tenant=tenant)
        if "webhook_url" in given:
            try:
                hook.url = validate_url(given["webhook_url"])
            except UpstreamURLError as exc:
                raise Unprocessable(f"webhook_url: {exc}", param="webhook_url") from None
            detail["webhook_url"] = hook.url
        sealed = signing_secret(given.get("webhook_secret"), has_one=bool(hook.secret_sealed),
                                param="webhook_secret")
        if sealed is not None:
            hook.secret_sealed, hook.secret_hint, made = sealed
            detail["webhook_secret_changed"] = True
        hook.updated_at = timezone.now()
        hook.save()
    if detail:
        record_action(actor=actor, action="tenant.billing", target=f"tenant:{tenant.slug}",
                     detail=detail)
    return Billing(**{**_billing(tenant).__dict__, "webhook_secret": made})


def _zone(name: Any) -> str:
    if not isinstance(name, str) or name not in _zones():
        raise Unprocessable("time_zone: an IANA time zone name, such as 'UTC' or "
                            "'Europe/Paris'.", param="time_zone")
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise Unprocessable("time_zone: this zone cannot be loaded here.",
                            param="time_zone") from None
    return name


_ZONES: set[str] = set()


def _zones() -> set[str]:
    if not _ZONES:
        _ZONES.update(available_timezones() | {"UTC"})
    return _ZONES


def _billing(tenant: Tenant) -> Billing:
    hook = AlertWebhook.objects.filter(tenant=tenant).first()
    return Billing(tenant_id=tenant.pk, time_zone=tenant.time_zone,
                   webhook_url=hook.url if hook else None,
                   webhook_secret_hint=hook.secret_hint if hook else None)
