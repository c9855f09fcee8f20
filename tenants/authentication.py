"""Bearer credentials (API key or JWT) to a Principal, or Unauthenticated.

One function, `authenticate`, used by every protocol adapter. Failures say what is wrong
in general terms ("expired", "revoked") without echoing the credential. A wrong API key
counts against the caller's source address (tenants/throttle.py): the adapter passes it,
and past the source's limit the answer is a 429 with Retry-After instead of a 401.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone

from sluice.errors import PermissionDenied, Unauthenticated
from tenants import apikeys, throttle
from tenants.models import ApiKey, Member, Tenant
from tenants.principal import AuthMethod, Principal
from tenants.roles import Role, can_grant, strongest
from tenants.tokens import verify_access_token

# last_used_at is informational: write it at most once a minute per key.
_LAST_USED_RESOLUTION = timedelta(minutes=1)


def authenticate(token: str, *, source: str | None = None) -> Principal:
    """`source`: the client's address (throttle.client_source); None counts no source."""
    token = token.strip()
    if not token:
        raise Unauthenticated("Missing bearer token.")
    if apikeys.looks_like_key(token):
        return authenticate_api_key(token, source=source)
    return authenticate_jwt(token)


def _models(value: Any) -> frozenset[str] | None:
    return frozenset(value) if isinstance(value, list) else None


def lookup_api_key(token: str, *, source: str | None = None) -> ApiKey:
    """The usable ApiKey row for a presented key, or Unauthenticated; RateLimited while
    wrong keys have locked `source` (checked before the database: a flood costs none)."""
    throttle.refuse_if_held(source)
    parsed = apikeys.parse(token)
    key = (
        ApiKey.objects.select_related("tenant", "member").filter(prefix=parsed.prefix).first()
        if parsed
        else None
    )
    if key is None or parsed is None or not apikeys.matches(parsed.full, key.key_hash):
        throttle.failed(throttle.Attempt(
            method=throttle.API_KEY, account=parsed.prefix if parsed else "", source=source,
            tenant_id=key.tenant_id if key else None,
            tenant_slug=key.tenant.slug if key else None))
        raise Unauthenticated("Incorrect API key provided.")
    now = timezone.now()
    if key.revoked_at is not None:
        raise Unauthenticated("This API key has been revoked.", code="revoked_api_key")
    if key.expires_at is not None and key.expires_at <= now:
        raise Unauthenticated("This API key has expired.", code="expired_api_key")
    if not key.tenant.is_active:
        raise Unauthenticated("This tenant is disabled.", code="tenant_disabled")
    if key.member is not None and (
        not key.member.is_active or not can_grant(key.member.role, key.role)
    ):
        # The owner left or was demoted below the key's role: the key must not outlive it.
        raise Unauthenticated("This API key's owner no longer holds its role.",
                              code="revoked_api_key")
    if key.last_used_at is None or key.last_used_at < now - _LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
    return key


def authenticate_api_key(token: str, *, source: str | None = None) -> Principal:
    key = lookup_api_key(token, source=source)
    return Principal(
        tenant_id=key.tenant_id,
        tenant_slug=key.tenant.slug,
        role=Role(key.role),
        subject=key.created_by,
        method=AuthMethod.API_KEY,
        member_id=key.member_id,
        key_id=key.pk,
        allowed_models=_models(key.allowed_models),
        key_prefix=key.prefix,
        priority=key.priority,
    )


def authenticate_jwt(token: str) -> Principal:
    verified = verify_access_token(token)
    claims = verified.claims
    if verified.external is not None:
        issuer = verified.external
        slug = issuer.tenant_slug(claims)
        tenant = Tenant.objects.filter(slug=slug, is_active=True).first() if slug else None
        if tenant is None:
            raise Unauthenticated("Token names no known tenant.", code="unknown_tenant")
        role = strongest(issuer.roles(claims))
        if role is None:
            raise PermissionDenied("Token carries no role mapped for this platform.")
        return Principal(
            tenant_id=tenant.pk,
            tenant_slug=tenant.slug,
            role=role,
            subject=f"oidc:{issuer.issuer}|{claims['sub']}",
            method=AuthMethod.OIDC,
        )

    # Our own token: re-check what may have changed since it was issued (tenant disabled,
    # member removed or demoted, key revoked), so revocation takes effect at once.
    tid, raw_role = claims.get("tid"), claims.get("role")
    if not isinstance(tid, int) or not isinstance(raw_role, str):
        raise Unauthenticated("Invalid access token: bad claims.", code="invalid_token")
    tenant = Tenant.objects.filter(pk=tid, is_active=True).first()
    try:
        role = Role(raw_role)
    except ValueError:
        raise Unauthenticated("Invalid access token: bad role.", code="invalid_token") from None
    if tenant is None:
        raise Unauthenticated("This tenant is disabled.", code="tenant_disabled")
    member_id, key_id = claims.get("mid"), claims.get("kid_api")
    key = None
    if key_id is not None:
        key = ApiKey.objects.filter(pk=key_id, tenant=tenant).first()
        if key is None or not key.is_usable():
            raise Unauthenticated("The API key behind this token was revoked.",
                                  code="revoked_api_key")
    if member_id is not None:
        member = Member.objects.filter(pk=member_id, tenant=tenant, is_active=True).first()
        if member is None or not can_grant(member.role, role):
            raise Unauthenticated("The member behind this token was removed or demoted.")
    return Principal(
        tenant_id=tenant.pk,
        tenant_slug=tenant.slug,
        role=role,
        subject=claims["sub"],
        method=AuthMethod.JWT,
        member_id=member_id,
        key_id=key_id,
        allowed_models=_models(claims.get("models")),
        key_prefix=key.prefix if key is not None else "",
        priority=key.priority if key is not None else 0,
    )
