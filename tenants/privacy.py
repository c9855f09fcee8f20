"""A tenant's data-protection policy: whether what Sluice stores beyond a call is
redacted, how many days it is kept (docs/AUDIT.md, "Data protection"), and whether the
models' prefix cache shares a prompt's blocks among all the tenant's calls or only
among one API key's (`prefix_cache`: "tenant", the default, or "key"; never across
tenants: docs/INFERENCE.md, "The prefix cache").

Each tenant either follows the platform defaults (`SLUICE_REDACT_STORED`, on;
`SLUICE_RETENTION_DAYS`, 30) or has its own value (`Tenant.redact_stored`,
`Tenant.retention_days`; None = the default). Only `tenant_privacy_update` changes them:
a tenant admin for their own tenant, a platform admin for any, each change audited.
The redaction itself happens in governance (governance/privacy.py), which reads the
policy from a cache that a change invalidates through EPOCH_KEY within about a second.

Retention covers conversations (here), stored responses (the Responses API, when it
lands, reads `retention_cutoffs` as conversations do) and batch files (streaming).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from sluice.auditlog import admin_action
from sluice.epoch import Epoch
from sluice.errors import Unprocessable
from tenants.models import MAX_RETENTION_DAYS, Conversation, ConversationMessage, Tenant
from tenants.principal import Principal
from tenants.roles import Action
from tenants.selectors import require, tenant_get

EPOCH_KEY = "sluice:privacy:epoch"
PREFIX_CACHE_SCOPES = ("tenant", "key")
_epoch = Epoch(EPOCH_KEY)


class _Keep:
    """The value of an argument that was not given: leave the setting as it is."""


KEEP: Final = _Keep()


@dataclass(frozen=True)
class PrivacyPolicy:
    """A tenant's effective policy (its own choice, else the platform default)."""

    redact_stored: bool
    retention_days: int
    prefix_cache_per_key: bool = False

    def cutoff(self, now: datetime | None = None) -> datetime:
        """What was stored (or last touched) before this is past retention."""
        return (now or timezone.now()) - timedelta(days=self.retention_days)


def effective(tenant: Tenant) -> PrivacyPolicy:
    return PrivacyPolicy(
        redact_stored=(settings.SLUICE_REDACT_STORED if tenant.redact_stored is None
                       else tenant.redact_stored),
        retention_days=tenant.retention_days or settings.SLUICE_RETENTION_DAYS,
        prefix_cache_per_key=tenant.prefix_cache_per_key)


def policy_of(tenant_id: int) -> PrivacyPolicy:
    """The policy of a tenant by id (a missing tenant gets the platform defaults)."""
    tenant = Tenant.objects.filter(pk=tenant_id).only(
        "redact_stored", "retention_days", "prefix_cache_per_key").first()
    return effective(tenant) if tenant is not None else effective(Tenant())


def privacy_get(*, actor: Principal, tenant_id: int) -> Tenant:
    """Anyone of the tenant may see its policy (developers should know whether their
    conversations are kept redacted); platform admins see every tenant's."""
    return tenant_get(actor=actor, tenant_id=tenant_id)


@transaction.atomic
def tenant_privacy_update(*, actor: Principal, tenant_id: int,
                          redact_stored: bool | _Keep | None = KEEP,
                          retention_days: int | _Keep | None = KEEP,
                          prefix_cache: str | _Keep = KEEP) -> Tenant:
    """Set a tenant's policy; None returns a setting to the platform default. A tenant
    admin may change their own tenant's, a platform admin any tenant's; another
    tenant is NotFound, a role without governance rights PermissionDenied. Audited as
    `tenant.privacy` with the old and new values; gateways see it within a second.
    `prefix_cache`: "tenant" or "key" (see the module)."""
    require(actor, Action.GOVERNANCE_MANAGE)
    tenant = tenant_get(actor=actor, tenant_id=tenant_id)
    tenant = Tenant.objects.select_for_update().get(pk=tenant.pk)
    if not isinstance(retention_days, _Keep) and retention_days is not None \
            and not 1 <= retention_days <= MAX_RETENTION_DAYS:
        raise Unprocessable(f"retention_days must be 1 to {MAX_RETENTION_DAYS}.",
                            param="retention_days")
    if not isinstance(prefix_cache, _Keep) and prefix_cache not in PREFIX_CACHE_SCOPES:
        raise Unprocessable("prefix_cache must be 'tenant' or 'key'.", param="prefix_cache")
    before = _settings(tenant)
    if not isinstance(redact_stored, _Keep):
        tenant.redact_stored = redact_stored
    if not isinstance(retention_days, _Keep):
        tenant.retention_days = retention_days
    if not isinstance(prefix_cache, _Keep):
        tenant.prefix_cache_per_key = prefix_cache == "key"
    tenant.save(update_fields=["redact_stored", "retention_days", "prefix_cache_per_key"])
    after = _settings(tenant)
    if after != before:
        _epoch.bump_on_commit()
    now = effective(tenant)
    # Flat scalars: the audit log keeps those as they are (nested values become text).
    admin_action(actor=actor, action="tenant.privacy", target=f"tenant:{tenant.slug}",
                 detail={**after, **{f"was_{k}": v for k, v in before.items()},
                         "effective_redact_stored": now.redact_stored,
                         "effective_retention_days": now.retention_days})
    return tenant


def _settings(tenant: Tenant) -> dict[str, object]:
    """The tenant's own choices, as the audit event records them."""
    return {"redact_stored": tenant.redact_stored, "retention_days": tenant.retention_days,
            "prefix_cache": prefix_cache_scope(tenant.prefix_cache_per_key)}


def prefix_cache_scope(per_key: bool) -> str:
    return "key" if per_key else "tenant"


# -- retention ------------------------------------------------------------------------
@dataclass(frozen=True)
class RetentionGroup:
    """The tenants that keep data for the same number of days: those on the platform
    default (`days` None) or those that chose `days`."""

    days: int | None
    cutoff: datetime

    def tenants(self, path: str = "tenant") -> Q:
        """A filter selecting this group's rows of a model that reaches Tenant by `path`."""
        if self.days is None:
            return Q(**{f"{path}__retention_days__isnull": True})
        return Q(**{f"{path}__retention_days": self.days})


def retention_groups(now: datetime | None = None) -> list[RetentionGroup]:
    """Every tenant in one group or another: one query per distinct retention, not per
    tenant."""
    now = now or timezone.now()
    groups = [RetentionGroup(None, now - timedelta(days=settings.SLUICE_RETENTION_DAYS))]
    own = Tenant.objects.filter(retention_days__isnull=False).order_by().values_list(
        "retention_days", flat=True).distinct()
    groups += [RetentionGroup(days, now - timedelta(days=days)) for days in own if days]
    return groups


def conversations_purge(now: datetime | None = None) -> dict[str, int]:
    """Delete conversation messages older than their tenant's retention, and
    conversations untouched for as long. Idempotent (deletes by age only)."""
    counts = {"messages": 0, "conversations": 0}
    for group in retention_groups(now):
        counts["messages"] += ConversationMessage.objects.filter(
            group.tenants("conversation__tenant"), created_at__lt=group.cutoff).delete()[0]
        _, deleted = Conversation.objects.filter(
            group.tenants(), updated_at__lt=group.cutoff).delete()
        counts["conversations"] += deleted.get("tenants.Conversation", 0)
    return counts
