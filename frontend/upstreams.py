"""Admin UI pages for upstream deployments (OpenAI-compatible servers Sluice fronts) and
model aliases (public names over weighted deployments and fallbacks). Platform admins
only; the same services and selectors as the management API decide what is valid.

An upstream's API key is a password field that is never filled in: the page says only
whether a key is set and, for a long one, its last four characters."""

from __future__ import annotations

import re
from typing import Any

from django import forms
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect

from frontend.forms import show_error
from frontend.paging import keyset
from frontend.session import page
from frontend.views import _deleted, _form_view, _page
from inference import selectors as inf
from inference import services as inf_services
from inference.models import ALIAS_PATTERN, Deployment
from inference.spec import RuntimeName
from inference.upstream.secrets import MAX_SECRET_LENGTH
from sluice.errors import ApiError, NotFound
from tenants.principal import Principal
from tenants.roles import Action

UPSTREAM_FIELDS = ("upstream_url", "upstream_model", "upstream_dialect", "max_context",
                   "upstream_concurrency", "upstream_connect_timeout_s",
                   "upstream_read_timeout_s", "description")
_TARGET = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,99})(?:\s*[=:]\s*([0-9]{1,5}))?$")


class UpstreamForm(forms.ModelForm):
    upstream_api_key = forms.CharField(
        label="API key", required=False, max_length=MAX_SECRET_LENGTH, strip=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="Sent as 'Authorization: Bearer …'. Stored encrypted; never shown again.")

    class Meta:
        model = Deployment
        fields: tuple[str, ...] = UPSTREAM_FIELDS
        labels = {"upstream_url": "Base URL", "upstream_model": "Upstream model name",
                  "upstream_dialect": "Server", "max_context": "Context length"}
        help_texts = {"upstream_url": "e.g. http://10.0.0.5:8000/v1 (loopback and private "
                                      "addresses need SLUICE_UPSTREAM_ALLOW_PRIVATE=true)",
                      "upstream_model": "The name the upstream serves it under."}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk and self.instance.upstream_secret:
            ending = self.instance.upstream_secret_hint
            said = f", ending in …{ending}" if ending else ""
            self.fields["upstream_api_key"].help_text = (
                f"A key is set{said}. Leave empty to keep it.")


class UpstreamCreateForm(UpstreamForm):
    class Meta(UpstreamForm.Meta):
        fields = ("name", *UPSTREAM_FIELDS)


class UpstreamEditForm(UpstreamForm):
    remove_api_key = forms.BooleanField(required=False, label="Remove the API key")


class AliasForm(forms.Form):
    description = forms.CharField(max_length=300, required=False)
    enabled = forms.BooleanField(required=False, initial=True)
    targets = forms.CharField(
        max_length=4000, widget=forms.Textarea(attrs={"rows": 4}),
        help_text="One deployment per line (or comma-separated), with its weight: "
                  "'big-a=3'. Calls are shared by weight.")
    fallbacks = forms.CharField(
        max_length=2000, required=False,
        help_text="Deployments tried in this order after the targets (comma-separated).")

    def clean_targets(self) -> list[tuple[str, int]]:
        out = []
        for part in re.split(r"[,\n]", self.cleaned_data["targets"]):
            if not part.strip():
                continue
            found = _TARGET.match(part.strip())
            if found is None:
                raise forms.ValidationError(f"Write 'deployment=weight', not '{part.strip()}'.")
            out.append((found[1], int(found[2] or 1)))
        return out

    def clean_fallbacks(self) -> list[str]:
        return [n.strip() for n in self.cleaned_data["fallbacks"].split(",") if n.strip()]


class AliasCreateForm(AliasForm):
    name = forms.RegexField(regex=ALIAS_PATTERN, max_length=100,
                            help_text="The model name callers send, e.g. "
                                      "meta-llama/Llama-3.1-8B-Instruct.")
    field_order = ["name", "description", "enabled", "targets", "fallbacks"]


def _key(data: dict[str, Any]) -> str | None:
    """The form's key field as the services take it (None: unchanged, "": removed)."""
    key = data.pop("upstream_api_key", "") or None
    return "" if data.pop("remove_api_key", False) else key


# -- upstreams -------------------------------------------------------------------------
@page(Action.DEPLOYMENT_MANAGE)
def upstream_list(request: HttpRequest, actor: Principal) -> HttpResponse:
    rows = keyset(request, inf.deployment_list(actor=actor).filter(
        runtime=RuntimeName.OPENAI_UPSTREAM))
    return _page(request, actor, "upstreams.html", page=rows)


@page(Action.DEPLOYMENT_MANAGE)
def upstream_new(request: HttpRequest, actor: Principal) -> HttpResponse:
    form = UpstreamCreateForm(request.POST or None)

    def save(data: dict[str, Any]) -> Any:
        key = _key(data)
        return inf_services.deployment_create(
            actor=actor, name=data.pop("name"), runtime=RuntimeName.OPENAI_UPSTREAM,
            upstream_api_key=key, **data)
    return _form_view(request, actor, form, title="New upstream", save=save,
                      done="/ui/upstreams", saved="Upstream created (disabled until "
                      "upstream workers exist).")


@page(Action.DEPLOYMENT_MANAGE)
def upstream_edit(request: HttpRequest, actor: Principal, name: str) -> HttpResponse:
    row = inf.deployment_get(actor=actor, name=name)
    if not row.is_upstream:
        raise NotFound(f"'{name}' is not an upstream deployment.")
    form = UpstreamEditForm(request.POST or None, instance=row)

    def save(data: dict[str, Any]) -> Any:
        key = _key(data)
        return inf_services.deployment_update(actor=actor, name=name, upstream_api_key=key,
                                              **data)
    return _form_view(request, actor, form, title=f"Upstream {name}", save=save,
                      done=f"/ui/upstreams/{name}", saved="Upstream saved.",
                      breaker_url=f"/ui/deployments/{name}/breaker")


# -- model aliases ---------------------------------------------------------------------
@page(Action.DEPLOYMENT_MANAGE)
def alias_list(request: HttpRequest, actor: Principal) -> HttpResponse:
    rows = keyset(request, inf.alias_list(actor=actor))
    return _page(request, actor, "aliases.html", page=rows,
                 rows=[(a, inf.route_of(a)) for a in rows.rows])


@page(Action.DEPLOYMENT_MANAGE)
def alias_new(request: HttpRequest, actor: Principal) -> HttpResponse:
    form = AliasCreateForm(request.POST or None)
    return _form_view(
        request, actor, form, title="New model alias",
        save=lambda data: inf_services.alias_create(actor=actor, **data),
        done="/ui/aliases", saved="Model alias created.")


@page(Action.DEPLOYMENT_MANAGE)
def alias_edit(request: HttpRequest, actor: Principal, name: str) -> HttpResponse:
    deleted = _deleted(request, lambda: inf_services.alias_delete(actor=actor, name=name),
                       done="/ui/aliases", what="Model alias")
    if deleted is not None:
        return deleted
    alias = inf.alias_get(actor=actor, name=name)
    route = inf.route_of(alias)
    initial = {"description": alias.description, "enabled": alias.enabled,
               "targets": "\n".join(f"{t.deployment}={t.weight}" for t in route.targets),
               "fallbacks": ", ".join(f.deployment for f in route.fallbacks)}
    form = AliasForm(request.POST or None, initial=initial)
    if request.method == "POST" and form.is_valid():
        try:
            inf_services.alias_update(actor=actor, name=name, **form.cleaned_data)
        except ApiError as exc:
            show_error(form, exc)
        else:
            messages.success(request, "Model alias saved.")
            return redirect(f"/ui/aliases/{name}/edit")
    total = sum(t.weight for t in route.targets) or 1
    # The form page (fields, Save, Delete) with how calls are shared now beneath it.
    return _page(request, actor, "alias_form.html",
                 status=422 if request.method == "POST" else 200, form=form,
                 title=f"Model alias {name}", deletable=True,
                 shares=[(t, round(100 * t.weight / total, 1)) for t in route.targets],
                 fallbacks=route.fallbacks)
