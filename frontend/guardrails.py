"""Admin UI pages for guardrail policies: the list (with the precedence it follows),
the form that creates one, and the one that edits or deletes it. The services decide
who may do what (governance/guardrails/services.py): tenant admins set their tenant's,
platform admins platform ones and anyone's, auditors read. A webhook's secret is shown
once, in the message after the policy that made it was created."""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect

from frontend import forms as ui_forms
from frontend.session import page
from frontend.views import _deleted, _form_view, _page
from governance.guardrail_models import GuardAction, GuardKind, GuardPhase, GuardScope, OnError
from governance.guardrails import services
from sluice.errors import ApiError
from tenants.principal import Principal
from tenants.roles import Action


@page(Action.GOVERNANCE_MANAGE, Action.AUDIT_READ)
def guardrails(request: HttpRequest, actor: Principal) -> HttpResponse:
    rows = list(services.guardrail_list(actor=actor)[:200])
    return _page(request, actor, "guardrails.html", rows=rows,
                 can_edit=actor.can(Action.GOVERNANCE_MANAGE))


class GuardrailForm(forms.Form):
    name = forms.CharField(max_length=64)
    action = forms.ChoiceField(choices=GuardAction.choices)
    categories = forms.CharField(max_length=400, required=False,
                                 help_text="Comma-separated (PII: EMAIL, CARD, ...; empty: "
                                           "all).")
    config = forms.CharField(widget=forms.Textarea(attrs={"rows": 4}), required=False,
                             help_text='JSON: words {"deny": [...]}; webhook {"url": ...}; '
                                       'classifier {"deployment": ..., "threshold": 0.5}.')
    secret = forms.CharField(widget=forms.PasswordInput, required=False, max_length=200,
                             help_text="A webhook's signing secret (empty: keep it, or "
                                       "one is made and shown once).")
    shadow = forms.BooleanField(required=False, help_text="Flag and audit only.")
    enabled = forms.BooleanField(required=False, initial=True)
    timeout_ms = forms.IntegerField(min_value=1, max_value=30_000, initial=1000)
    on_error = forms.ChoiceField(choices=OnError.choices, initial=OnError.OPEN)

    def clean_categories(self) -> list[str]:
        raw = self.cleaned_data["categories"]
        return [c.strip() for c in raw.split(",") if c.strip()]

    def clean_config(self) -> dict[str, Any]:
        raw = self.cleaned_data["config"].strip()
        if not raw:
            return {}
        try:
            value = json.loads(raw)
        except ValueError:
            raise forms.ValidationError("Not valid JSON.") from None
        if not isinstance(value, dict):
            raise forms.ValidationError("A JSON object.")
        return value


class GuardrailCreateForm(GuardrailForm):
    guard = forms.ChoiceField(choices=GuardKind.choices)
    phase = forms.ChoiceField(choices=GuardPhase.choices)
    scope = forms.ChoiceField(choices=GuardScope.choices, initial=GuardScope.TENANT)
    tenant_id = forms.IntegerField(min_value=1, required=False, label="Tenant id",
                                   help_text="Platform admins: the tenant (default: yours).")
    key_id = forms.IntegerField(min_value=1, required=False, label="API key id",
                                help_text="For scope 'key'.")
    deployment = forms.CharField(max_length=100, required=False,
                                 help_text="For scope 'deployment': a deployment or alias.")
    mandatory = forms.BooleanField(required=False, help_text="Platform policies only: "
                                                             "tenants cannot weaken it.")

    field_order = ["name", "guard", "phase", "action", "scope", "tenant_id", "key_id",
                   "deployment", "categories", "config", "secret", "mandatory", "shadow",
                   "enabled", "timeout_ms", "on_error"]

    def __init__(self, *args: Any, actor: Principal, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not actor.can(Action.GOVERNANCE_MANAGE_ANY):
            del self.fields["tenant_id"]
            del self.fields["mandatory"]


def _given(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if v not in (None, "")}


@page(Action.GOVERNANCE_MANAGE)
def guardrail_new(request: HttpRequest, actor: Principal) -> HttpResponse:
    form = GuardrailCreateForm(request.POST or None, actor=actor)
    if request.method == "POST" and form.is_valid():
        try:
            row, made = services.guardrail_create(actor=actor, **_given(form.cleaned_data))
        except ApiError as exc:
            ui_forms.show_error(form, exc)
        else:
            note = f" Its webhook secret (shown once): {made}" if made else ""
            messages.success(request, f"Guardrail policy '{row.name}' created.{note}")
            return redirect("/ui/guardrails")
    status = 422 if request.method == "POST" else 200
    return _page(request, actor, "form.html", status=status, form=form,
                 title="New guardrail policy")


@page(Action.GOVERNANCE_MANAGE)
def guardrail_edit(request: HttpRequest, actor: Principal, policy_id: int) -> HttpResponse:
    deleted = _deleted(request, lambda: services.guardrail_delete(actor=actor,
                                                                  policy_id=policy_id),
                       done="/ui/guardrails", what="Guardrail policy")
    if deleted is not None:
        return deleted
    row = services.guardrail_get(actor=actor, policy_id=policy_id)
    initial = {"name": row.name, "action": row.action, "shadow": row.shadow,
               "categories": ", ".join(row.categories or ()), "enabled": row.enabled,
               "config": json.dumps(row.config, indent=1) if row.config else "",
               "timeout_ms": row.timeout_ms, "on_error": row.on_error}
    form = GuardrailForm(request.POST or None, initial=initial)
    return _form_view(request, actor, form,
                      title=f"Guardrail #{policy_id}: {row.guard} ({row.phase}, {row.scope})",
                      save=lambda data: services.guardrail_update(
                          actor=actor, policy_id=policy_id,
                          **{k: v for k, v in data.items() if k != "secret" or v}),
                      done="/ui/guardrails", saved="Guardrail policy saved.",
                      deletable=True)
