"""People in the browser: username + password (and the tenant, for someone in several),
checked, throttled and audited by the same service as the API's token
(services.member_sign_in), a Django session holding the membership, and the same
Principal and RBAC table as the API. Every page is a `page(...)` view: no principal ->
the login page; a role without the page's action -> 403; an ApiError from a service ->
its status and message."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth import login as django_login
from django.contrib.auth import logout as django_logout
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from django.shortcuts import redirect, render
from django.utils.http import url_has_allowed_host_and_scheme

from sluice.errors import ApiError, PermissionDenied
from tenants import throttle
from tenants.models import Member
from tenants.principal import AuthMethod, Principal
from tenants.roles import Action, Role
from tenants.services import member_sign_in

SESSION_MEMBER = "sluice_member_id"
View = Callable[..., HttpResponseBase]


def sign_in(request: HttpRequest, *, username: str, password: str,
            tenant: str | None) -> Member:
    """Unauthenticated (one message for every reason), RateLimited while throttled,
    Unprocessable when the tenant must be named; else the session is signed in."""
    member = member_sign_in(username=username, password=password, tenant=tenant or None,
                            source=throttle.http_source(request.META))
    django_login(request, member.user)  # a new session id: no fixation
    request.session[SESSION_MEMBER] = member.pk
    return member


def sign_out(request: HttpRequest) -> None:
    django_logout(request)


def principal_of(request: HttpRequest) -> Principal | None:
    """The signed-in member as a Principal, re-read on every request: a member removed,
    demoted or a tenant disabled loses access at once."""
    member_id = request.session.get(SESSION_MEMBER)
    if member_id is None or not request.user.is_authenticated:
        return None
    member = Member.objects.select_related("tenant").filter(
        pk=member_id, user=request.user, is_active=True, tenant__is_active=True).first()
    if member is None:
        return None
    return Principal(tenant_id=member.tenant_id, tenant_slug=member.tenant.slug,
                     role=Role(member.role), subject=member.subject,
                     method=AuthMethod.SESSION, member_id=member.pk)


def safe_next(request: HttpRequest, default: str) -> str:
    target = request.GET.get("next") or request.POST.get("next") or ""
    if target and url_has_allowed_host_and_scheme(target, {request.get_host()},
                                                   require_https=request.is_secure()):
        return target
    return default


def page(*actions: Action) -> Callable[[View], View]:
    """A signed-in page for roles holding any of `actions` (none: any member)."""
    def wrap(view: View) -> View:
        @wraps(view)
        def inner(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            actor = principal_of(request)
            if actor is None:
                return redirect(f"/ui/login?next={request.get_full_path()}")
            try:
                if actions and not any(actor.can(a) for a in actions):
                    raise PermissionDenied(f"Your role ({actor.role}) may not open this page.")
                return view(request, actor, *args, **kwargs)
            except ApiError as exc:
                return render(request, "frontend/error.html",
                              {"actor": actor, "error": exc}, status=exc.status)
        return inner
    return wrap
