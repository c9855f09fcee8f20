"""Writes for tenants, members and API keys. Every function checks the actor's rights
itself, so the API, the admin UI and management commands cannot diverge."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth import authenticate as django_authenticate
from django.contrib.auth import get_user_model
from django.contrib.auth.models import User as AuthUser
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from sluice.auditlog import admin_action
from sluice.errors import Conflict, PermissionDenied, Unauthenticated, Unprocessable
from tenants import apikeys, throttle
from tenants import cache as auth_cache
from tenants.authentication import lookup_api_key
from tenants.models import ApiKey, Member, Tenant
from tenants.principal import AuthMethod, Principal
from tenants.roles import Action, Role, can_grant
from tenants.selectors import apikey_get, member_get, require, tenant_get
from tenants.tokens import IssuedToken, issue_access_token

User = get_user_model()
_ADMIN_ROLES = (Role.TENANT_ADMIN, Role.PLATFORM_ADMIN)


@dataclass(frozen=True)
class NewUser:
    username: str
    email: str
    password: str


def _require_grant(actor: Principal, role: Role) -> None:
    if not can_grant(actor.role, role):
        raise PermissionDenied(f"A {actor.role} cannot grant the role {role}.", param="role")


def _require_key_rights(actor: Principal, *, role: Role, priority: int,
                        allowed_models: list[str] | None, verb: str) -> None:
    """What a key may carry for `actor` to create it, or revoke it: priority only for
    those who manage every key, a role the actor may grant, a model scope within the
    actor's own (None: every model)."""
    if priority and not actor.can(Action.APIKEY_MANAGE_ALL):
        raise PermissionDenied(f"Only tenant admins may {verb} priority keys.",
                               param="priority")
    _require_grant(actor, role)
    if actor.allowed_models is not None and (
            allowed_models is None or not set(allowed_models) <= actor.allowed_models):
        raise PermissionDenied("allowed_models exceeds your own.", param="allowed_models")


def _create_user(new: NewUser) -> AuthUser:
    try:
        validate_password(new.password)
    except ValidationError as exc:
        raise Unprocessable(" ".join(exc.messages), param="password") from None
    if User.objects.filter(username=new.username).exists():
        raise Conflict("That username is taken.", param="username")
    return User.objects.create_user(username=new.username, email=new.email, password=new.password)


# -- tenants -------------------------------------------------------------------------
@transaction.atomic
def tenant_create(*, actor: Principal, slug: str, name: str, admin: NewUser | None) -> Tenant:
    require(actor, Action.TENANT_CREATE)
    try:
        with transaction.atomic():
            tenant = Tenant.objects.create(slug=slug, name=name)
    except IntegrityError:
        raise Conflict("A tenant with that slug exists.", param="slug") from None
    if admin is not None:
        Member.objects.create(tenant=tenant, user=_create_user(admin), role=Role.TENANT_ADMIN)
    admin_action(actor=actor, action="tenant.create", target=f"tenant:{tenant.slug}")
    return tenant


@transaction.atomic
def tenant_update(
    *, actor: Principal, tenant_id: int, name: str | None = None, is_active: bool | None = None
) -> Tenant:
    require(actor, Action.TENANT_UPDATE)
    tenant = tenant_get(actor=actor, tenant_id=tenant_id)
    if is_active is False and tenant.pk == actor.tenant_id:
        raise Conflict("You cannot disable your own tenant.", param="is_active")
    if name is not None:
        tenant.name = name
    if is_active is not None:
        tenant.is_active = is_active
    tenant.save(update_fields=["name", "is_active"])
    if is_active is False:
        auth_cache.invalidate()
    admin_action(actor=actor, action="tenant.update", target=f"tenant:{tenant.slug}",
                 detail={"is_active": tenant.is_active})
    return tenant


# -- members -------------------------------------------------------------------------
@transaction.atomic
def member_create(*, actor: Principal, new: NewUser, role: Role) -> Member:
    require(actor, Action.MEMBER_MANAGE)
    _require_grant(actor, role)
    member = Member.objects.create(tenant_id=actor.tenant_id, user=_create_user(new), role=role)
    admin_action(actor=actor, action="member.create", target=f"member:{member.pk}",
                 detail={"role": role})
    return member


def _ensure_admin_remains(member: Member) -> None:
    others = Member.objects.filter(
        tenant_id=member.tenant_id, role__in=_ADMIN_ROLES, is_active=True
    ).exclude(pk=member.pk)
    if member.role in _ADMIN_ROLES and not others.exists():
        raise Conflict("A tenant must keep at least one active admin.")


def _revoke_keys_beyond(member: Member, role: Role | None) -> None:
    """Revoke the member's keys that `role` could not grant (all of them for None)."""
    keys = ApiKey.objects.filter(member=member, revoked_at__isnull=True)
    doomed = [k.pk for k in keys if role is None or not can_grant(role, k.role)]
    ApiKey.objects.filter(pk__in=doomed).update(revoked_at=timezone.now())


@transaction.atomic
def member_update(
    *, actor: Principal, member_id: int, role: Role | None = None, is_active: bool | None = None
) -> Member:
    require(actor, Action.MEMBER_MANAGE)
    # Lock the tenant's admins first: two admins demoting each other at once must not
    # both win and leave the tenant without one.
    admins = Member.objects.select_for_update().filter(tenant_id=actor.tenant_id,
                                                       role__in=_ADMIN_ROLES)
    list(admins)
    member = member_get(actor=actor, member_id=member_id)
    # A member above the actor cannot be changed by them, nor raised above the actor.
    _require_grant(actor, Role(member.role))
    if role is not None:
        _require_grant(actor, role)
        if role not in _ADMIN_ROLES:
            _ensure_admin_remains(member)
        member.role = role
        _revoke_keys_beyond(member, role)
    if is_active is False:
        _ensure_admin_remains(member)
        _revoke_keys_beyond(member, None)
    if is_active is not None:
        member.is_active = is_active
    member.save(update_fields=["role", "is_active"])
    auth_cache.invalidate()
    admin_action(actor=actor, action="member.update", target=f"member:{member.pk}",
                 detail={"role": member.role, "is_active": member.is_active})
    return member


# -- API keys ------------------------------------------------------------------------
@dataclass(frozen=True)
class CreatedKey:
    key: ApiKey
    secret: str  # shown once, never stored


@transaction.atomic
def apikey_create(
    *,
    actor: Principal,
    name: str,
    role: Role | None = None,
    expires_at: datetime | None = None,
    allowed_models: list[str] | None = None,
    priority: int = 0,
) -> CreatedKey:
    require(actor, Action.APIKEY_MANAGE_ALL, Action.APIKEY_MANAGE_OWN)
    role = role or actor.role
    # A key can narrow the caller's model scope, never widen it: none named, its own.
    if actor.allowed_models is not None and allowed_models is None:
        allowed_models = sorted(actor.allowed_models)
    _require_key_rights(actor, role=role, priority=priority, allowed_models=allowed_models,
                        verb="create")
    if expires_at is not None and expires_at <= timezone.now():
        raise Unprocessable("expires_at must be in the future.", param="expires_at")
    if actor.key_id is not None:
        parent = ApiKey.objects.filter(pk=actor.key_id).first()
        ceiling = parent.expires_at if parent is not None else None
        if ceiling is not None and (expires_at is None or expires_at > ceiling):
            expires_at = ceiling  # a key cannot outlive the key that made it
    secret, prefix, digest = apikeys.generate()
    key = ApiKey.objects.create(
        tenant_id=actor.tenant_id,
        name=name,
        prefix=prefix,
        key_hash=digest,
        role=role,
        created_by=actor.subject,
        member_id=actor.member_id,
        allowed_models=sorted(set(allowed_models)) if allowed_models is not None else None,
        expires_at=expires_at,
        priority=priority,
    )
    admin_action(actor=actor, action="apikey.create", target=f"apikey:{key.prefix}",
                 detail={"role": role, "priority": priority})
    return CreatedKey(key=key, secret=secret)


@transaction.atomic
def apikey_revoke(*, actor: Principal, key_id: int) -> ApiKey:
    """Revoking takes the rights creating the key would: a key out of the actor's reach
    is NotFound (selectors), one within reach that it could not have made (a role above
    what it may grant, priority, a wider model scope) is PermissionDenied."""
    key = apikey_get(actor=actor, key_id=key_id)
    _require_key_rights(actor, role=Role(key.role), priority=key.priority,
                        allowed_models=key.allowed_models, verb="revoke")
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
        auth_cache.invalidate()
    admin_action(actor=actor, action="apikey.revoke", target=f"apikey:{key.prefix}")
    return key


# -- sign-in and tokens --------------------------------------------------------------
_SIGN_IN_REFUSED = "Incorrect username or password."


def member_sign_in(*, username: str, password: str, tenant: str | None,
                   source: str | None) -> Member:
    """The active membership these credentials open (`member.user` is the authenticated
    user), for the API's token and the UI's session alike.

    One refusal for every reason (unknown user, wrong password, deactivated user or
    member, disabled tenant, no membership in `tenant`): Unauthenticated, same message,
    after the same work (one password hash, the same queries), so neither the answer
    nor its timing tells a deactivated account from a wrong password. Throttled per
    username and per `source` (tenants/throttle.py): RateLimited while either is locked,
    without checking the password; each refusal is counted and audited."""
    attempt = throttle.Attempt(method=throttle.PASSWORD, account=username, source=source)
    throttle.check(attempt)
    # Django's backend hashes the password for an unknown or inactive user too.
    user = django_authenticate(username=username, password=password)
    # Asked even when the password failed (for no one), so both paths query alike.
    members = Member.objects.filter(user_id=user.pk if user is not None else 0,
                                    is_active=True, tenant__is_active=True)
    if tenant is not None:
        members = members.filter(tenant__slug=tenant)
    found = list(members.select_related("tenant")[:2])
    if user is None or not found:
        throttle.failed(attempt)
        raise Unauthenticated(_SIGN_IN_REFUSED, code="invalid_credentials")
    throttle.succeeded(attempt)
    if len(found) > 1:
        raise Unprocessable("You belong to several tenants: name one in `tenant`.",
                            param="tenant")
    member = found[0]
    member.user = user  # the instance Django's backend annotated (login() needs it)
    return member


def token_for_api_key(*, api_key: str, source: str | None = None) -> IssuedToken:
    key = lookup_api_key(api_key, source=source)
    return issue_access_token(
        subject=key.created_by,
        tenant_id=key.tenant_id,
        role=key.role,
        member_id=key.member_id,
        key_id=key.pk,
        allowed_models=key.allowed_models,
    )


def token_for_password(*, username: str, password: str, tenant: str | None,
                       source: str | None = None) -> IssuedToken:
    member = member_sign_in(username=username, password=password, tenant=tenant,
                            source=source)
    return issue_access_token(
        subject=member.subject,
        tenant_id=member.tenant_id,
        role=member.role,
        member_id=member.pk,
        key_id=None,
        allowed_models=None,
    )


# -- demo ----------------------------------------------------------------------------
@dataclass(frozen=True)
class DemoCredentials:
    tenant: str
    username: str
    password: str
    api_key: str


@transaction.atomic
def demo_seed(*, username: str = "admin", tenant_slug: str = "demo") -> DemoCredentials:
    """Idempotent: the demo tenant and its platform admin exist afterwards, the admin's
    password is reset to a fresh random one and a fresh developer key is made."""
    tenant, _ = Tenant.objects.get_or_create(slug=tenant_slug, defaults={"name": "Demo tenant"})
    password = secrets.token_urlsafe(12)
    user = User.objects.filter(username=username).first()
    if user is None:
        user = User.objects.create_user(username=username, email="admin@demo.invalid")
    user.set_password(password)
    user.save(update_fields=["password"])
    member, _ = Member.objects.update_or_create(
        tenant=tenant, user=user, defaults={"role": Role.PLATFORM_ADMIN, "is_active": True}
    )
    admin = Principal(
        tenant_id=tenant.pk, tenant_slug=tenant.slug, role=Role.PLATFORM_ADMIN,
        subject=member.subject, method=AuthMethod.SESSION, member_id=member.pk,
    )
    created = apikey_create(actor=admin, name="demo key", role=Role.DEVELOPER)
    return DemoCredentials(tenant.slug, username, password, created.secret)
