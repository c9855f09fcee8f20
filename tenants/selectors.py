"""Reads, always scoped by the caller. An object outside the caller's reach is NotFound
(the same answer as a missing one, so ids of other tenants cannot be probed); a caller
whose role lacks the action altogether is PermissionDenied."""

from __future__ import annotations

from typing import TypeVar

from django.db.models import Model, QuerySet

from sluice.errors import NotFound, PermissionDenied
from tenants.models import ApiKey, Member, Tenant
from tenants.principal import Principal
from tenants.roles import Action

M = TypeVar("M", bound=Model)


def require(actor: Principal, *actions: Action) -> None:
    """Pass if the actor holds any of the actions."""
    if not any(actor.can(action) for action in actions):
        raise PermissionDenied(f"Your role ({actor.role}) may not do this.")


def tenant_list(*, actor: Principal) -> QuerySet[Tenant]:
    require(actor, Action.TENANT_LIST)
    return Tenant.objects.order_by("id")


def tenant_get(*, actor: Principal, tenant_id: int) -> Tenant:
    require(actor, Action.TENANT_READ_ANY, Action.TENANT_READ_OWN)
    if not actor.can(Action.TENANT_READ_ANY) and tenant_id != actor.tenant_id:
        raise NotFound("No such tenant.")
    tenant = Tenant.objects.filter(pk=tenant_id).first()
    if tenant is None:
        raise NotFound("No such tenant.")
    return tenant


def member_list(*, actor: Principal) -> QuerySet[Member]:
    require(actor, Action.MEMBER_READ)
    return Member.objects.filter(tenant_id=actor.tenant_id).select_related("user").order_by("id")


def member_get(*, actor: Principal, member_id: int) -> Member:
    member = member_list(actor=actor).filter(pk=member_id).first()
    if member is None:
        raise NotFound("No such member.")
    return member


def owned(actor: Principal, objects: QuerySet[M], *, manage_all: Action,
          manage_own: Action) -> QuerySet[M]:
    """The tenant's objects for someone who may manage them all, else the caller's own
    (`created_by` is the caller's subject)."""
    require(actor, manage_all, manage_own)
    found = objects.filter(tenant_id=actor.tenant_id)
    if not actor.can(manage_all):
        found = found.filter(created_by=actor.subject)
    return found.order_by("id")


def apikey_list(*, actor: Principal) -> QuerySet[ApiKey]:
    return owned(actor, ApiKey.objects.all(), manage_all=Action.APIKEY_MANAGE_ALL,
                 manage_own=Action.APIKEY_MANAGE_OWN)


def apikey_get(*, actor: Principal, key_id: int) -> ApiKey:
    key = apikey_list(actor=actor).filter(pk=key_id).first()
    if key is None:
        raise NotFound("No such API key.")
    return key
