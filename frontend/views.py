"""The admin UI's pages. Each parses the request, calls the same services and selectors
as the management API, and renders; decisions (who may, what is valid) are theirs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django import forms as django_forms
from django.contrib import messages
from django.http import (
    FileResponse,
    HttpRequest,
    HttpResponse,
    HttpResponseNotAllowed,
    JsonResponse,
    StreamingHttpResponse,
)
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from frontend import forms
from frontend.paging import keyset
from frontend.session import page, principal_of, safe_next, sign_in, sign_out
from governance import live
from governance import selectors as gov
from governance import services as gov_services
from governance.audit import verify
from governance.exports import export_file
from inference import selectors as inf
from inference import services as inf_services
from sluice.errors import ApiError
from tenants import selectors as ten
from tenants import services as ten_services
from tenants import tool_policy
from tenants.conversations import conversation_list
from tenants.principal import Principal
from tenants.roles import Action, Role

_STREAM_TICKS = 600  # one a second
NAV: list[tuple[str, str, tuple[Action, ...]]] = [
    ("Dashboard", "/ui/dashboard", (Action.MODEL_LIST,)),
    ("Tenants", "/ui/tenants", (Action.TENANT_LIST,)),
    ("Deployments", "/ui/deployments", (Action.DEPLOYMENT_MANAGE,)),
    ("Upstreams", "/ui/upstreams", (Action.DEPLOYMENT_MANAGE,)),
    ("Model aliases", "/ui/aliases", (Action.DEPLOYMENT_MANAGE,)),
    ("Quotas", "/ui/quotas", (Action.GOVERNANCE_MANAGE,)),
    ("Rate limits", "/ui/limits", (Action.GOVERNANCE_MANAGE,)),
    ("Tool policy", "/ui/tool-policy", (Action.GOVERNANCE_MANAGE,)),
    ("Members", "/ui/members", (Action.MEMBER_READ,)),
    ("API keys", "/ui/keys", (Action.APIKEY_MANAGE_OWN,)),
    ("Spend", "/ui/spend", (Action.GOVERNANCE_MANAGE, Action.AUDIT_READ,
                            Action.APIKEY_MANAGE_OWN)),
    ("Budgets", "/ui/budgets", (Action.GOVERNANCE_MANAGE, Action.AUDIT_READ)),
    ("Guardrails", "/ui/guardrails", (Action.GOVERNANCE_MANAGE, Action.AUDIT_READ)),
    ("Prices", "/ui/prices", (Action.MODEL_LIST,)),
    ("Usage", "/ui/usage", (Action.APIKEY_MANAGE_OWN,)),
    ("Conversations", "/ui/conversations", (Action.MODEL_USE,)),
    ("Audit log", "/ui/audit", (Action.AUDIT_READ,)),
]


def _page(request: HttpRequest, actor: Principal, template: str, status: int = 200,
          **context: Any) -> HttpResponse:
    nav = [(label, url) for label, url, needs in NAV if any(actor.can(a) for a in needs)]
    return render(request, f"frontend/{template}", {"actor": actor, "nav": nav,
                                                    "path": request.path, **context},
                  status=status)


def _form_view(request: HttpRequest, actor: Principal, form: django_forms.BaseForm, *,
               title: str, save: Callable[[dict[str, Any]], Any], done: str,
               saved: str, **context: Any) -> HttpResponse:
    """GET shows the form; POST validates it, calls `save` (a service), and redirects
    to `done`, or shows the form again with the errors inline (nothing saved: the
    services are atomic)."""
    if request.method == "POST" and form.is_valid():
        try:
            save(form.cleaned_data)
        except ApiError as exc:
            forms.show_error(form, exc)
        else:
            messages.success(request, saved)
            return redirect(done)
    status = 422 if request.method == "POST" else 200
    return _page(request, actor, "form.html", status=status, form=form, title=title,
                 **context)


# -- sign-in -------------------------------------------------------------------------
@require_http_methods(["GET", "POST"])
def login_view(request: HttpRequest) -> HttpResponse:
    form = forms.LoginForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            sign_in(request, username=form.cleaned_data["username"],
                    password=form.cleaned_data["password"],
                    tenant=form.cleaned_data["tenant"] or None)
        except ApiError as exc:
            forms.show_error(form, exc)
        else:
            return redirect(safe_next(request, "/ui/"))
    return render(request, "frontend/login.html", {"form": form},
                  status=401 if request.method == "POST" else 200)


@require_http_methods(["POST"])
def logout_view(request: HttpRequest) -> HttpResponse:
    sign_out(request)
    return redirect("/ui/login")


def home(request: HttpRequest) -> HttpResponse:
    actor = principal_of(request)
    if actor is None:
        return redirect("/ui/login")
    first = next((url for _, url, needs in NAV if any(actor.can(a) for a in needs)), None)
    return redirect(first or "/ui/keys")


# -- dashboard -------------------------------------------------------------------------
@page(Action.MODEL_LIST)
def dashboard(request: HttpRequest, actor: Principal) -> HttpResponse:
    return _page(request, actor, "dashboard.html", snapshot=live.dashboard())


async def dashboard_stream(request: HttpRequest) -> StreamingHttpResponse | HttpResponse:
    """Server-Sent Events: the dashboard's figures once a second."""
    actor = await sync_to_async(principal_of)(request)
    if actor is None or not actor.can(Action.MODEL_LIST):
        return HttpResponse(status=403)

    async def events() -> AsyncIterator[bytes]:
        # Ten minutes, then the browser's EventSource reconnects by itself: a stream
        # whose reader vanished without the server noticing cannot run forever.
        yield b"retry: 1000\n\n"
        for _ in range(_STREAM_TICKS):
            data = await sync_to_async(live.dashboard)()
            yield b"data: " + json.dumps(data).encode() + b"\n\n"
            await asyncio.sleep(1.0)

    response = StreamingHttpResponse(events(), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


# -- platform ------------------------------------------------------------------------
@page(Action.TENANT_LIST)
def tenants(request: HttpRequest, actor: Principal) -> HttpResponse:
    rows = keyset(request, ten.tenant_list(actor=actor))
    return _page(request, actor, "tenants.html", page=rows)


@page(Action.TENANT_CREATE)
def tenant_new(request: HttpRequest, actor: Principal) -> HttpResponse:
    form = forms.TenantForm(request.POST or None)

    def save(data: dict[str, Any]) -> Any:
        admin = ten_services.NewUser(username=data["admin_username"],
                                     email=data["admin_email"],
                                     password=data["admin_password"]) \
            if data["admin_username"] else None
        return ten_services.tenant_create(actor=actor, slug=data["slug"], name=data["name"],
                                          admin=admin)
    return _form_view(request, actor, form, title="New tenant", save=save,
                      done="/ui/tenants", saved="Tenant created.")


@page(Action.DEPLOYMENT_MANAGE)
def deployments(request: HttpRequest, actor: Principal) -> HttpResponse:
    rows = keyset(request, inf.deployment_list(actor=actor))
    states = live.scaling_states()
    return _page(request, actor, "deployments.html", page=rows,
                 rows=[(d, states.get(d.name, {})) for d in rows.rows])


@page(Action.DEPLOYMENT_MANAGE)
def deployment(request: HttpRequest, actor: Principal, name: str) -> HttpResponse:
    row = inf.deployment_get(actor=actor, name=name)
    form = forms.DeploymentForm(request.POST or None, instance=row)
    return _form_view(
        request, actor, form, title=f"Deployment {name}: batching, queue, autoscaling",
        save=lambda data: inf_services.deployment_update(actor=actor, name=name, **data),
        done=f"/ui/deployments/{name}", saved="Deployment saved.",
        scaling=inf.scaling(actor=actor, name=name, limit=20),
        breaker_url=f"/ui/deployments/{name}/breaker")


@page(Action.GOVERNANCE_MANAGE_ANY)
def breaker(request: HttpRequest, actor: Principal, name: str) -> HttpResponse:
    policy = gov.breaker_get(actor=actor, deployment=name)
    form = forms.BreakerForm(request.POST or None, instance=policy)
    return _form_view(
        request, actor, form, title=f"Circuit breaker of {name}",
        save=lambda data: gov_services.breaker_update(actor=actor, deployment=name, **data),
        done=f"/ui/deployments/{name}/breaker", saved="Breaker thresholds saved.",
        breaker_state=live.breaker_state(policy))


# -- quotas and limits -----------------------------------------------------------------
@page(Action.GOVERNANCE_MANAGE)
def quotas(request: HttpRequest, actor: Principal) -> HttpResponse:
    """Tenant admins read their tenant's quotas and current use; platform admins set
    them (the API's rule)."""
    rows = keyset(request, gov.quota_list(actor=actor).select_related("tenant"))
    return _page(request, actor, "quotas.html", page=rows,
                 rows=[(q, live.quota_use(q)) for q in rows.rows],
                 can_edit=actor.can(Action.GOVERNANCE_MANAGE_ANY))


@page(Action.GOVERNANCE_MANAGE_ANY)
def quota_new(request: HttpRequest, actor: Principal) -> HttpResponse:
    form = forms.QuotaCreateForm(request.POST or None, actor=actor)
    return _form_view(
        request, actor, form, title="New quota",
        save=lambda data: gov_services.quota_create(
            actor=actor, tenant_id=data.pop("tenant").pk, **data),
        done="/ui/quotas", saved="Quota created.")


def _deleted(request: HttpRequest, delete: Callable[[], Any], *, done: str,
             what: str) -> HttpResponse | None:
    """An edit page's Delete button: the service deletes, the list shows."""
    if request.method == "POST" and request.POST.get("delete"):
        delete()
        messages.success(request, f"{what} deleted.")
        return redirect(done)
    return None


@page(Action.GOVERNANCE_MANAGE_ANY)
def quota_edit(request: HttpRequest, actor: Principal, quota_id: int) -> HttpResponse:
    deleted = _deleted(request, lambda: gov_services.quota_delete(actor=actor,
                                                                  quota_id=quota_id),
                       done="/ui/quotas", what="Quota")
    if deleted is not None:
        return deleted
    quota = gov.quota_get(actor=actor, quota_id=quota_id)
    form = forms.QuotaForm(request.POST or None, instance=quota)
    return _form_view(
        request, actor, form, title=f"Quota #{quota_id} of {quota.tenant.slug}",
        save=lambda data: gov_services.quota_update(actor=actor, quota_id=quota_id, **data),
        done="/ui/quotas", saved="Quota saved.", deletable=True)


@page(Action.GOVERNANCE_MANAGE)
def limits(request: HttpRequest, actor: Principal) -> HttpResponse:
    rows = keyset(request, gov.ratelimit_list(actor=actor))
    return _page(request, actor, "limits.html", page=rows)


@page(Action.GOVERNANCE_MANAGE)
def limit_new(request: HttpRequest, actor: Principal) -> HttpResponse:
    form = forms.RateLimitCreateForm(request.POST or None, actor=actor)

    def save(data: dict[str, Any]) -> Any:
        tenant = data.pop("tenant", None)
        return gov_services.ratelimit_create(actor=actor,
                                             tenant_id=tenant.pk if tenant else None,
                                             api_key_id=data.pop("api_key_id"), **data)
    return _form_view(request, actor, form, title="New rate limit", save=save,
                      done="/ui/limits", saved="Rate limit created.")


@page(Action.GOVERNANCE_MANAGE)
def limit_edit(request: HttpRequest, actor: Principal, policy_id: int) -> HttpResponse:
    deleted = _deleted(request, lambda: gov_services.ratelimit_delete(actor=actor,
                                                                      policy_id=policy_id),
                       done="/ui/limits", what="Rate limit")
    if deleted is not None:
        return deleted
    policy = gov.ratelimit_get(actor=actor, policy_id=policy_id)
    form = forms.RateLimitForm(request.POST or None, instance=policy)
    return _form_view(
        request, actor, form, title=f"Rate limit {policy}",
        save=lambda data: gov_services.ratelimit_update(actor=actor, policy_id=policy_id,
                                                        **data),
        done="/ui/limits", saved="Rate limit saved.", deletable=True,
        rates=live.effective_rates(policy))


# -- tenant ----------------------------------------------------------------------------
@page(Action.GOVERNANCE_MANAGE)
def tool_policy_edit(request: HttpRequest, actor: Principal,
                     tenant_id: int | None = None) -> HttpResponse:
    """The tenant's hosted tool policy: the actor's own tenant, or (a platform admin's
    link from the tenant list) the one named."""
    tenant = tool_policy.tool_policy_get(actor=actor, tenant_id=tenant_id or actor.tenant_id)
    form = forms.ToolPolicyForm(request.POST or None,
                                initial={"hosted_tools": tenant.hosted_tools})
    here = request.path
    return _form_view(
        request, actor, form, title=f"Hosted tools of {tenant.slug}",
        save=lambda data: tool_policy.tenant_tool_policy_update(
            actor=actor, tenant_id=tenant.pk, hosted_tools=data["hosted_tools"]),
        done=here, saved="Tool policy saved.")


@page(Action.MEMBER_READ)
def members(request: HttpRequest, actor: Principal) -> HttpResponse:
    rows = keyset(request, ten.member_list(actor=actor))
    return _page(request, actor, "members.html", page=rows)


@page(Action.MEMBER_MANAGE)
def member_edit(request: HttpRequest, actor: Principal, member_id: int) -> HttpResponse:
    member = ten.member_get(actor=actor, member_id=member_id)
    form = forms.MemberEditForm(request.POST or None, initial={
        "role": member.role, "is_active": member.is_active})
    return _form_view(
        request, actor, form, title=f"Member {member.user.username}",
        save=lambda data: ten_services.member_update(
            actor=actor, member_id=member_id, role=Role(data["role"]),
            is_active=data["is_active"]),
        done="/ui/members", saved="Member saved.")


@page(Action.MEMBER_MANAGE)
def member_new(request: HttpRequest, actor: Principal) -> HttpResponse:
    form = forms.MemberForm(request.POST or None)
    return _form_view(
        request, actor, form, title="New member",
        save=lambda data: ten_services.member_create(
            actor=actor, role=Role(data.pop("role")), new=ten_services.NewUser(**data)),
        done="/ui/members", saved="Member added.")


@page(Action.APIKEY_MANAGE_OWN, Action.APIKEY_MANAGE_ALL)
def keys(request: HttpRequest, actor: Principal) -> HttpResponse:
    rows = keyset(request, ten.apikey_list(actor=actor), newest_first=True)
    return _page(request, actor, "keys.html", page=rows)


@page(Action.APIKEY_MANAGE_OWN, Action.APIKEY_MANAGE_ALL)
def key_new(request: HttpRequest, actor: Principal) -> HttpResponse:
    form = forms.KeyForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            created = ten_services.apikey_create(
                actor=actor, name=data["name"], role=Role(data["role"]) if data["role"]
                else None, expires_at=data["expires_at"],
                allowed_models=data["allowed_models"], priority=data["priority"] or 0)
        except ApiError as exc:
            forms.show_error(form, exc)
        else:
            # The secret is shown on this response only: never stored, never again.
            response = _page(request, actor, "key_created.html", key=created.key,
                             secret=created.secret)
            response["Cache-Control"] = "no-store"
            return response
    return _page(request, actor, "form.html", status=422 if request.method == "POST" else 200,
                 form=form, title="New API key")


@page(Action.APIKEY_MANAGE_OWN, Action.APIKEY_MANAGE_ALL)
def key_revoke(request: HttpRequest, actor: Principal, key_id: int) -> HttpResponse:
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    key = ten_services.apikey_revoke(actor=actor, key_id=key_id)
    messages.success(request, f"Key {key.prefix} revoked.")
    return redirect("/ui/keys")


@page(Action.APIKEY_MANAGE_OWN)
def usage(request: HttpRequest, actor: Principal) -> HttpResponse:
    rows = keyset(request, gov.own_usage(actor=actor), newest_first=True)
    return _page(request, actor, "usage.html", page=rows)


@page(Action.MODEL_USE)
def conversations(request: HttpRequest, actor: Principal) -> HttpResponse:
    rows = keyset(request, conversation_list(actor=actor), newest_first=True)
    return _page(request, actor, "conversations.html", page=rows)


# -- audit -------------------------------------------------------------------------------
@page(Action.AUDIT_READ)
def audit(request: HttpRequest, actor: Principal) -> HttpResponse:
    form = forms.AuditFilterForm(request.GET or None)
    filters = {k: v for k, v in form.cleaned_data.items() if v not in (None, "")} \
        if form.is_valid() else {}
    actor_filter = filters.pop("actor", None)
    rows = keyset(request, gov.audit_events(actor=actor, actor_filter=actor_filter,
                                            **filters), newest_first=True)
    return _page(request, actor, "audit.html", form=form, page=rows,
                 status=200 if not form.errors else 422,
                 export_form=forms.ExportForm(prefix="export",
                                              initial={"format": "jsonl", **filters}))


@page(Action.AUDIT_READ)
def audit_event(request: HttpRequest, actor: Principal, event_id: int) -> HttpResponse:
    return _page(request, actor, "audit_event.html",
                 event=gov.audit_event_get(actor=actor, event_id=event_id))


@page(Action.AUDIT_READ)
def audit_verify(request: HttpRequest, actor: Principal) -> HttpResponse:
    chain = None if actor.can(Action.TENANT_READ_ANY) else actor.tenant_slug
    problems = verify(chain) if request.method == "POST" else None
    return _page(request, actor, "audit_verify.html", problems=problems, chain=chain)


@page(Action.AUDIT_READ)
def export_new(request: HttpRequest, actor: Principal) -> HttpResponse:
    form = forms.ExportForm(request.POST or None, prefix="export")
    if request.method == "POST" and form.is_valid():
        data = {k: v for k, v in form.cleaned_data.items() if v not in (None, "")}
        export = gov_services.audit_export_create(actor=actor, format=data.pop("format"),
                                                  actor_filter=data.pop("actor", None),
                                                  **data)
        return redirect(f"/ui/audit/exports/{export.pk}")
    return _page(request, actor, "form.html", status=422 if form.errors else 200,
                 form=form, title="Export audit events")


@page(Action.AUDIT_READ)
def export_status(request: HttpRequest, actor: Principal, export_id: int) -> HttpResponse:
    export = gov.audit_export_get(actor=actor, export_id=export_id)
    if request.GET.get("format") == "json":
        return JsonResponse({"status": export.status, "done": export.done,
                             "total": export.total, "error": export.error})
    return _page(request, actor, "export.html", export=export)


@page(Action.AUDIT_READ)
def export_download(request: HttpRequest, actor: Principal,
                    export_id: int) -> HttpResponse | FileResponse:
    return export_file(gov.audit_export_get(actor=actor, export_id=export_id))


_STATIC = Path(__file__).resolve().parent / "static" / "frontend"
_JS, _CSS = "text/javascript; charset=utf-8", "text/css; charset=utf-8"
_TYPES = {"app.js": _JS, "app.css": _CSS, "spend.js": _JS, "uplot.min.js": _JS,
          "uplot.min.css": _CSS}


def static_file(request: HttpRequest, name: str) -> HttpResponse:
    """The UI's own static files and the vendored ones beside them (VENDORED.md; no
    collectstatic, no CDN)."""
    if name not in _TYPES:
        return HttpResponse(status=404)
    response = HttpResponse((_STATIC / name).read_bytes(), content_type=_TYPES[name])
    response["Cache-Control"] = "public, max-age=300"
    return response
