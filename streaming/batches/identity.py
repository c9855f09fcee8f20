"""Who runs a batch: the creator's principal, frozen on the batch row when it is created
and resolved again before every chunk (and about every second while one runs).

A batch holds no credential to present again, so `resolve` re-applies what
tenants/authentication.py checks on each request for the credential the principal came
from: the tenant is active; an API key still exists in that tenant, is neither revoked
nor expired, and its owner (if any) is active and may still grant the key's role; a
member (a JWT of ours, a session) is still active and may still hold the role. The
principal it returns carries what is current now: the key's role, allow-list and
priority as they are in the database, not as they were when the batch was created.
An identity that no longer passes raises `Revoked`; the runner then ends the batch with
`credential_revoked` and runs none of its remaining lines.

An external (OIDC) principal has no row behind it but its tenant: only that is checked.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tenants.models import ApiKey, Member, Tenant
from tenants.principal import AuthMethod, Principal
from tenants.roles import Role, can_grant


class Revoked(Exception):
    """The identity behind a batch may no longer act: tenant disabled, key revoked or
    expired, member removed or demoted."""


def frozen(principal: Principal) -> dict[str, Any]:
    """The principal as JSON for the batch row."""
    data = dataclasses.asdict(principal)
    if data["allowed_models"] is not None:
        data["allowed_models"] = sorted(data["allowed_models"])
    return data


def thawed(data: dict[str, Any]) -> Principal:
    models = data.get("allowed_models")
    return Principal(**{**data, "role": Role(data["role"]), "method": AuthMethod(data["method"]),
                        "allowed_models": frozenset(models) if models is not None else None})


def resolve(data: dict[str, Any]) -> Principal:
    """The batch's principal as it stands now (see the module's doc), or Revoked."""
    principal = thawed(data)
    tenant = Tenant.objects.filter(pk=principal.tenant_id, is_active=True).first()
    if tenant is None:
        raise Revoked("The tenant behind this batch was disabled.")
    if principal.key_id is not None:
        key = ApiKey.objects.select_related("member").filter(
            pk=principal.key_id, tenant=tenant).first()
        if key is None or not key.is_usable():
            raise Revoked("The API key behind this batch was revoked or expired.")
        owner = key.member
        if owner is not None and (not owner.is_active or not can_grant(owner.role, key.role)):
            raise Revoked("The API key's owner no longer holds its role.")
        if principal.method == AuthMethod.API_KEY:
            models = key.allowed_models
            return dataclasses.replace(
                principal, tenant_slug=tenant.slug, role=Role(key.role),
                member_id=key.member_id,
                allowed_models=frozenset(models) if isinstance(models, list) else None,
                priority=key.priority)
    if principal.member_id is not None:
        member = Member.objects.filter(pk=principal.member_id, tenant=tenant,
                                       is_active=True).first()
        if member is None or not can_grant(member.role, principal.role):
            raise Revoked("The member behind this batch was removed or demoted.")
    return dataclasses.replace(principal, tenant_slug=tenant.slug)
