"""The typed principal handed to every handler: who is calling, for which tenant, as what."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tenants.roles import Action, Role, can


class AuthMethod(StrEnum):
    API_KEY = "api_key"
    JWT = "jwt"  # a token this platform issued
    OIDC = "oidc"  # a token from a trusted external issuer
    SESSION = "session"  # the admin UI


@dataclass(frozen=True, slots=True)
class Principal:
    tenant_id: int
    tenant_slug: str
    role: Role
    # The human (or external identity) behind the call: "member:<id>" or "oidc:<iss>|<sub>".
    subject: str
    method: AuthMethod
    member_id: int | None = None
    key_id: int | None = None
    # None: any model the tenant may use. A key's allow-list narrows it.
    allowed_models: frozenset[str] | None = None
    key_prefix: str = ""  # the API key's public prefix (usage records), "" for others
    priority: int = 0  # the key's traffic priority, 0 = normal

    def can(self, action: Action) -> bool:
        return can(self.role, action)

    def may_use_model(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models
