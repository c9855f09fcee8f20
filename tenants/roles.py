"""The four roles and the one permission table that every surface consults.

REST, SSE, gRPC, WebSocket and the admin UI all ask `can(role, action)`; nothing else
decides who may do what. A role may grant another only if its own actions are a superset
(so a tenant admin can make auditors and developers, a developer can make developer keys,
and nobody can hand out more than they hold).
"""

from __future__ import annotations

from enum import StrEnum

from django.db import models


class Role(models.TextChoices):
    PLATFORM_ADMIN = "platform_admin", "Platform admin"
    TENANT_ADMIN = "tenant_admin", "Tenant admin"
    DEVELOPER = "developer", "Developer"
    AUDITOR = "auditor", "Auditor"


class Action(StrEnum):
    TENANT_CREATE = "tenant.create"
    TENANT_LIST = "tenant.list"
    TENANT_READ_ANY = "tenant.read_any"
    TENANT_UPDATE = "tenant.update"
    TENANT_READ_OWN = "tenant.read_own"
    MEMBER_READ = "member.read"
    MEMBER_MANAGE = "member.manage"
    APIKEY_MANAGE_ALL = "apikey.manage_all"  # every key of the tenant
    APIKEY_MANAGE_OWN = "apikey.manage_own"  # keys the caller created
    MODEL_USE = "model.use"  # chat, completions, embeddings, one's own conversations
    CONVERSATION_MANAGE_ALL = "conversation.manage_all"  # every conversation of the tenant
    MODEL_LIST = "model.list"
    AUDIT_READ = "audit.read"
    # Read the tenant's limits, quotas and usage; set limits on its own API keys.
    GOVERNANCE_MANAGE = "governance.manage"
    # Every tenant's limits and quotas, the platform defaults, breaker thresholds.
    GOVERNANCE_MANAGE_ANY = "governance.manage_any"
    DEPLOYMENT_MANAGE = "deployment.manage"


_DEVELOPER = frozenset({
    Action.TENANT_READ_OWN, Action.APIKEY_MANAGE_OWN, Action.MODEL_USE, Action.MODEL_LIST,
})
_AUDITOR = frozenset({
    Action.TENANT_READ_OWN, Action.APIKEY_MANAGE_OWN, Action.AUDIT_READ, Action.MODEL_LIST,
})
_TENANT_ADMIN = _DEVELOPER | _AUDITOR | {
    Action.MEMBER_READ, Action.MEMBER_MANAGE, Action.APIKEY_MANAGE_ALL,
    Action.GOVERNANCE_MANAGE, Action.CONVERSATION_MANAGE_ALL,
}
_PLATFORM_ADMIN = _TENANT_ADMIN | {
    Action.TENANT_CREATE, Action.TENANT_LIST, Action.TENANT_READ_ANY, Action.TENANT_UPDATE,
    Action.DEPLOYMENT_MANAGE, Action.GOVERNANCE_MANAGE_ANY,
}

PERMISSIONS: dict[Role, frozenset[Action]] = {
    Role.PLATFORM_ADMIN: frozenset(_PLATFORM_ADMIN),
    Role.TENANT_ADMIN: frozenset(_TENANT_ADMIN),
    Role.DEVELOPER: _DEVELOPER,
    Role.AUDITOR: _AUDITOR,
}


def can(role: Role | str, action: Action) -> bool:
    return action in PERMISSIONS[Role(role)]


def can_grant(granter: Role | str, role: Role | str) -> bool:
    """A role can be handed out only by someone who holds every action it carries."""
    return PERMISSIONS[Role(role)] <= PERMISSIONS[Role(granter)]


def strongest(roles: list[Role]) -> Role | None:
    """The role with the most actions (used when an external token maps to several)."""
    return max(roles, key=lambda r: len(PERMISSIONS[r]), default=None)
