"""Management API shapes for tenants, members, keys and tokens."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from ninja import Schema
from pydantic import EmailStr, Field, StringConstraints

from sluice.schemas import Line, StrictSchema
from tenants.conversations import conversation_messages
from tenants.models import (
    MAX_RETENTION_DAYS,
    SLUG_PATTERN,
    Conversation,
    ConversationMessage,
    HostedTools,
    Member,
)
from tenants.roles import Role

Slug = Annotated[str, StringConstraints(pattern=SLUG_PATTERN, max_length=63)]
# Names and titles are one line of text (sluice.schemas.Line: no control characters).
Name = Annotated[Line, StringConstraints(min_length=1, max_length=200)]
Username = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.@+-]{1,150}$")]
Password = Annotated[str, StringConstraints(min_length=1, max_length=512)]
ModelName = Annotated[Line, StringConstraints(min_length=1, max_length=200)]


class PrincipalOut(Schema):
    tenant_id: int
    tenant: str
    role: Role
    subject: str
    method: str
    key_id: int | None
    allowed_models: list[str] | None


class TenantOut(Schema):
    id: int
    slug: str
    name: str
    is_active: bool
    created_at: datetime


class NewUserIn(StrictSchema):
    username: Username
    email: EmailStr
    password: Password


class TenantCreateIn(StrictSchema):
    slug: Slug
    name: Name
    admin: NewUserIn | None = None


class TenantUpdateIn(StrictSchema):
    name: Name | None = None
    is_active: bool | None = None


class MemberOut(Schema):
    id: int
    username: str
    email: str
    role: Role
    is_active: bool
    created_at: datetime

    @staticmethod
    def resolve_username(obj: Member) -> str:
        return obj.user.get_username()

    @staticmethod
    def resolve_email(obj: Member) -> str:
        return str(getattr(obj.user, "email", ""))


class MemberCreateIn(NewUserIn):
    role: Role


class MemberUpdateIn(StrictSchema):
    role: Role | None = None
    is_active: bool | None = None


class ApiKeyOut(Schema):
    id: int
    name: str
    display: str
    role: Role
    created_by: str
    allowed_models: list[str] | None
    priority: int
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None
    created_at: datetime


class ApiKeyCreatedOut(ApiKeyOut):
    key: str = Field(description="The secret. Shown once: store it now.")


class ApiKeyCreateIn(StrictSchema):
    name: Name
    role: Role | None = None
    expires_at: datetime | None = None
    allowed_models: Annotated[list[ModelName], Field(max_length=100)] | None = None
    priority: Annotated[int, Field(ge=0, le=9)] = 0


class TokenIn(StrictSchema):
    grant_type: Literal["api_key", "password"]
    api_key: Annotated[Line, StringConstraints(max_length=512)] | None = None
    username: Annotated[Line, StringConstraints(max_length=150)] | None = None
    password: Password | None = None
    tenant: Slug | None = None


class TokenOut(Schema):
    access_token: str
    token_type: Literal["Bearer"] = "Bearer"  # noqa: S105 - not a secret
    expires_in: int


class ConversationOut(Schema):
    id: str
    title: str
    created_by: str
    created_at: datetime
    updated_at: datetime

    @staticmethod
    def resolve_id(obj: Conversation) -> str:
        return obj.public_id


class MessageOut(Schema):
    role: str
    content: str
    created_at: datetime


class ConversationDetailOut(ConversationOut):
    messages: list[MessageOut]

    @staticmethod
    def resolve_messages(obj: Conversation) -> list[ConversationMessage]:
        return list(conversation_messages(obj))


class ConversationCreateIn(StrictSchema):
    title: Annotated[Line, StringConstraints(max_length=200)] = ""


class PrivacyOut(Schema):
    """A tenant's data-protection policy: its own choices (None: the platform default)
    and what applies now."""

    tenant_id: int
    redact_stored: bool | None
    retention_days: int | None
    effective_redact_stored: bool
    effective_retention_days: int
    prefix_cache: Literal["tenant", "key"]  # who shares cached prompt blocks


class PrivacyIn(StrictSchema):
    """Fields left out stay as they are; null returns one to the platform default."""

    redact_stored: bool | None = None
    retention_days: Annotated[int, Field(ge=1, le=MAX_RETENTION_DAYS)] | None = None
    prefix_cache: Literal["tenant", "key"] | None = None  # null: "tenant"


class ToolPolicyOut(Schema):
    """What a tenant's calls do with hosted tools Sluice cannot run (`web_search`...):
    `drop` them (named in `x-sluice-dropped-tools` and the audit event) or `refuse` the
    call (a 400 naming the tool)."""

    tenant_id: int
    hosted_tools: HostedTools


class ToolPolicyIn(StrictSchema):
    hosted_tools: HostedTools
