"""Management API for identity: who am I, tenants, members, API keys; and the token
exchange. Handlers only parse, call a selector or service, and serialize."""

from __future__ import annotations

from django.http import HttpRequest
from ninja import Router, Status
from ninja.pagination import paginate

from sluice.errors import BadRequest
from sluice.pagination import Pagination
from tenants import conversations, privacy, selectors, services, throttle, tool_policy
from tenants.models import Tenant
from tenants.principal import Principal
from tenants.schemas import (
    ApiKeyCreatedOut,
    ApiKeyCreateIn,
    ApiKeyOut,
    ConversationCreateIn,
    ConversationDetailOut,
    ConversationOut,
    MemberCreateIn,
    MemberOut,
    MemberUpdateIn,
    NewUserIn,
    PrincipalOut,
    PrivacyIn,
    PrivacyOut,
    TenantCreateIn,
    TenantOut,
    TenantUpdateIn,
    TokenIn,
    TokenOut,
    ToolPolicyIn,
    ToolPolicyOut,
)

router = Router(tags=["identity"])
auth_router = Router(tags=["auth"], auth=None)


def actor_of(request: HttpRequest) -> Principal:
    """The authenticated principal that BearerAuth put on the request."""
    principal = request.auth  # type: ignore[attr-defined]
    assert isinstance(principal, Principal)  # noqa: S101 - set by BearerAuth
    return principal


def _new_user(data: NewUserIn) -> services.NewUser:
    return services.NewUser(username=data.username, email=data.email, password=data.password)


@router.get("/me", response=PrincipalOut)
def me(request: HttpRequest) -> dict[str, object]:
    p = actor_of(request)
    return {
        "tenant_id": p.tenant_id, "tenant": p.tenant_slug, "role": p.role,
        "subject": p.subject, "method": p.method, "key_id": p.key_id,
        "allowed_models": sorted(p.allowed_models) if p.allowed_models is not None else None,
    }


# -- tenants -------------------------------------------------------------------------
@router.get("/tenants", response=list[TenantOut])
@paginate(Pagination)
def tenant_list(request: HttpRequest):
    return selectors.tenant_list(actor=actor_of(request))


@router.post("/tenants", response={201: TenantOut})
def tenant_create(request: HttpRequest, data: TenantCreateIn):
    admin = _new_user(data.admin) if data.admin else None
    return Status(201, services.tenant_create(
        actor=actor_of(request), slug=data.slug, name=data.name, admin=admin
    ))


@router.get("/tenants/{int:tenant_id}", response=TenantOut)
def tenant_get(request: HttpRequest, tenant_id: int):
    return selectors.tenant_get(actor=actor_of(request), tenant_id=tenant_id)


@router.patch("/tenants/{int:tenant_id}", response=TenantOut)
def tenant_update(request: HttpRequest, tenant_id: int, data: TenantUpdateIn):
    return services.tenant_update(
        actor=actor_of(request), tenant_id=tenant_id, name=data.name, is_active=data.is_active
    )


def _privacy(tenant: Tenant) -> dict[str, object]:
    now = privacy.effective(tenant)
    return {"tenant_id": tenant.pk, "redact_stored": tenant.redact_stored,
            "retention_days": tenant.retention_days,
            "effective_redact_stored": now.redact_stored,
            "effective_retention_days": now.retention_days,
            "prefix_cache": privacy.prefix_cache_scope(tenant.prefix_cache_per_key)}


@router.get("/tenants/{int:tenant_id}/privacy", response=PrivacyOut)
def tenant_privacy_get(request: HttpRequest, tenant_id: int):
    return _privacy(privacy.privacy_get(actor=actor_of(request), tenant_id=tenant_id))


@router.patch("/tenants/{int:tenant_id}/privacy", response=PrivacyOut)
def tenant_privacy_update(request: HttpRequest, tenant_id: int, data: PrivacyIn):
    given = {name: getattr(data, name) for name in data.model_fields_set}
    if "prefix_cache" in given:
        given["prefix_cache"] = given["prefix_cache"] or "tenant"
    return _privacy(privacy.tenant_privacy_update(actor=actor_of(request),
                                                  tenant_id=tenant_id, **given))


@router.get("/tenants/{int:tenant_id}/tool-policy", response=ToolPolicyOut)
def tenant_tool_policy_get(request: HttpRequest, tenant_id: int):
    tenant = tool_policy.tool_policy_get(actor=actor_of(request), tenant_id=tenant_id)
    return {"tenant_id": tenant.pk, "hosted_tools": tenant.hosted_tools}


@router.patch("/tenants/{int:tenant_id}/tool-policy", response=ToolPolicyOut)
def tenant_tool_policy_update(request: HttpRequest, tenant_id: int, data: ToolPolicyIn):
    tenant = tool_policy.tenant_tool_policy_update(
        actor=actor_of(request), tenant_id=tenant_id, hosted_tools=data.hosted_tools)
    return {"tenant_id": tenant.pk, "hosted_tools": tenant.hosted_tools}


# -- members -------------------------------------------------------------------------
@router.get("/members", response=list[MemberOut])
@paginate(Pagination)
def member_list(request: HttpRequest):
    return selectors.member_list(actor=actor_of(request))


@router.post("/members", response={201: MemberOut})
def member_create(request: HttpRequest, data: MemberCreateIn):
    return Status(201, services.member_create(
        actor=actor_of(request), new=_new_user(data), role=data.role
    ))


@router.get("/members/{int:member_id}", response=MemberOut)
def member_get(request: HttpRequest, member_id: int):
    return selectors.member_get(actor=actor_of(request), member_id=member_id)


@router.patch("/members/{int:member_id}", response=MemberOut)
def member_update(request: HttpRequest, member_id: int, data: MemberUpdateIn):
    return services.member_update(
        actor=actor_of(request), member_id=member_id, role=data.role, is_active=data.is_active
    )


@router.delete("/members/{int:member_id}", response=MemberOut)
def member_deactivate(request: HttpRequest, member_id: int):
    return services.member_update(actor=actor_of(request), member_id=member_id, is_active=False)


# -- API keys ------------------------------------------------------------------------
@router.get("/keys", response=list[ApiKeyOut])
@paginate(Pagination)
def apikey_list(request: HttpRequest):
    return selectors.apikey_list(actor=actor_of(request))


@router.post("/keys", response={201: ApiKeyCreatedOut})
def apikey_create(request: HttpRequest, data: ApiKeyCreateIn):
    created = services.apikey_create(
        actor=actor_of(request),
        name=data.name,
        role=data.role,
        expires_at=data.expires_at,
        allowed_models=data.allowed_models,
        priority=data.priority,
    )
    out = ApiKeyOut.from_orm(created.key).model_dump()
    return Status(201, {**out, "key": created.secret})


@router.get("/keys/{int:key_id}", response=ApiKeyOut)
def apikey_get(request: HttpRequest, key_id: int):
    return selectors.apikey_get(actor=actor_of(request), key_id=key_id)


@router.delete("/keys/{int:key_id}", response=ApiKeyOut)
def apikey_revoke(request: HttpRequest, key_id: int):
    return services.apikey_revoke(actor=actor_of(request), key_id=key_id)


# -- conversations -------------------------------------------------------------------
@router.get("/conversations", response=list[ConversationOut])
@paginate(Pagination)
def conversation_list(request: HttpRequest):
    return conversations.conversation_list(actor=actor_of(request))


@router.post("/conversations", response={201: ConversationOut})
def conversation_create(request: HttpRequest, data: ConversationCreateIn):
    return Status(201, conversations.conversation_create(actor=actor_of(request),
                                                         title=data.title))


@router.get("/conversations/{conversation_id}", response=ConversationDetailOut)
def conversation_get(request: HttpRequest, conversation_id: str):
    return conversations.conversation_get(actor=actor_of(request), public_id=conversation_id)


@router.delete("/conversations/{conversation_id}", response={204: None})
def conversation_delete(request: HttpRequest, conversation_id: str):
    conversations.conversation_delete(actor=actor_of(request), public_id=conversation_id)
    return Status(204, None)


# -- token exchange ------------------------------------------------------------------
@auth_router.post("/token", response=TokenOut)
def token(request: HttpRequest, data: TokenIn):
    source = throttle.http_source(request.META)  # wrong credentials count against it
    if data.grant_type == "api_key":
        if not data.api_key:
            raise BadRequest("grant_type api_key needs `api_key`.", param="api_key")
        issued = services.token_for_api_key(api_key=data.api_key, source=source)
    else:
        if not data.username or not data.password:
            raise BadRequest("grant_type password needs `username` and `password`.",
                             param="username")
        issued = services.token_for_password(
            username=data.username, password=data.password, tenant=data.tenant, source=source
        )
    return {"access_token": issued.access_token, "expires_in": issued.expires_in}
