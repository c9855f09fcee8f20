"""A tenant's policy for hosted tools: the tools an API's provider runs on its own side
(OpenAI's `web_search`, `code_interpreter`...; Anthropic's server tools), which Sluice
cannot run.

`Tenant.hosted_tools` is `drop` (the default: such a tool is not offered to the model,
the reply names it in `x-sluice-dropped-tools` and the call's audit event records it)
or `refuse` (a 400 naming the tool). The codecs apply it (streaming/apis/hosted.py);
they read it with `hosted_tools_policy`, cached in-process for
SLUICE_POLICY_CACHE_TTL_S and dropped by every process within about a second of a
change (EPOCH_KEY), so a call with hosted tools costs no query. Only
`tenant_tool_policy_update` changes it: a tenant admin for their own tenant, a platform
admin for any, each change audited.
"""

from __future__ import annotations

from django.conf import settings
from django.db import transaction

from sluice.auditlog import admin_action
from sluice.db import async_db
from sluice.epoch import Epoch
from sluice.ttlcache import AsyncTTLCache
from tenants.models import HostedTools, Tenant
from tenants.principal import Principal
from tenants.roles import Action
from tenants.selectors import require, tenant_get

EPOCH_KEY = "sluice:tools:epoch"
_epoch = Epoch(EPOCH_KEY)
_policies: AsyncTTLCache[int, HostedTools] = AsyncTTLCache(max_entries=100_000)


def tool_policy_get(*, actor: Principal, tenant_id: int) -> Tenant:
    """Anyone of the tenant may see its policy (a developer should know why a tool was
    dropped); platform admins see every tenant's. Another tenant is NotFound."""
    return tenant_get(actor=actor, tenant_id=tenant_id)


@transaction.atomic
def tenant_tool_policy_update(*, actor: Principal, tenant_id: int,
                              hosted_tools: HostedTools) -> Tenant:
    """Set what the tenant's calls do with hosted tools. A tenant admin may change their
    own tenant's, a platform admin any tenant's; another tenant is NotFound (as a
    missing one), a role without governance rights PermissionDenied. Audited as
    `tenant.tool_policy` with the old and new value; gateways see it within a second."""
    require(actor, Action.GOVERNANCE_MANAGE)
    tenant = tenant_get(actor=actor, tenant_id=tenant_id)
    tenant = Tenant.objects.select_for_update().get(pk=tenant.pk)
    before = tenant.hosted_tools
    tenant.hosted_tools = HostedTools(hosted_tools)
    tenant.save(update_fields=["hosted_tools"])
    if tenant.hosted_tools != before:
        invalidate()
    admin_action(actor=actor, action="tenant.tool_policy", target=f"tenant:{tenant.slug}",
                 detail={"hosted_tools": str(tenant.hosted_tools), "was_hosted_tools": before})
    return tenant


def _load(tenant_id: int) -> HostedTools:
    value = Tenant.objects.filter(pk=tenant_id).values_list("hosted_tools", flat=True).first()
    try:
        return HostedTools(value or "")
    except ValueError:  # a missing tenant, or a value no release wrote: the default
        return HostedTools.DROP


async def hosted_tools_policy(tenant_id: int) -> HostedTools:
    """The tenant's policy, from the in-process cache (see the module's doc)."""
    if await _epoch.moved():
        _policies.clear()
    return await _policies.get(tenant_id, lambda: async_db(_load)(tenant_id),
                               float(settings.SLUICE_POLICY_CACHE_TTL_S))


def invalidate() -> None:
    """Every process's cache drops the policies once the transaction commits (this
    process's at once)."""
    _epoch.bump_on_commit()
    transaction.on_commit(_policies.clear)


def clear() -> None:
    _policies.clear()
    _epoch.reset()
