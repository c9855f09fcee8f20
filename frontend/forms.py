"""Forms: they parse what a browser sends into the typed arguments of the services (the
same services the API calls); the services decide. A service's refusal comes back as an
inline error on the field it names (`param`), or above the form."""

from __future__ import annotations

from typing import Any

from django import forms

from governance.models import BreakerPolicy, Quota, RateLimitPolicy
from governance.selectors import governed_tenants
from governance.services import BREAKER_FIELDS, QUOTA_FIELDS, RATELIMIT_FIELDS
from inference.models import Deployment
from sluice.errors import ApiError
from tenants.models import HostedTools, Tenant
from tenants.principal import Principal
from tenants.roles import Action, Role


def show_error(form: forms.BaseForm, exc: ApiError) -> None:
    """Put a service's refusal next to its field (or above the form)."""
    field = exc.param if exc.param in form.fields else None
    form.add_error(field, exc.message)


class LoginForm(forms.Form):
    username = forms.CharField(max_length=150)
    password = forms.CharField(max_length=200, widget=forms.PasswordInput)
    tenant = forms.SlugField(max_length=64, required=False,
                             help_text="Only if you belong to several tenants.")


class TenantChoice(forms.ModelChoiceField):
    def label_from_instance(self, obj: Any) -> str:
        return f"{obj.slug} ({obj.name})"


def _tenant_field(required: bool) -> TenantChoice:
    # No choices until the form knows its actor (ActorForm): a list of every tenant is
    # never rendered, nor accepted, by default.
    return TenantChoice(queryset=Tenant.objects.none(), required=required,
                        empty_label="(platform default)" if not required else None)


class ActorForm(forms.ModelForm):
    """A form whose choice lists come from the actor's selectors: what the actor may
    not see is neither offered nor accepted ("Select a valid choice", the same answer
    as for an id that does not exist)."""

    def __init__(self, *args: Any, actor: Principal, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tenant = self.fields.get("tenant")
        if isinstance(tenant, TenantChoice):
            tenant.queryset = governed_tenants(actor=actor)


class QuotaForm(forms.ModelForm):
    class Meta:
        model = Quota
        fields: tuple[str, ...] = QUOTA_FIELDS


class QuotaCreateForm(ActorForm, QuotaForm):
    tenant = _tenant_field(required=True)

    class Meta(QuotaForm.Meta):
        fields = ("tenant", *QUOTA_FIELDS)


class RateLimitForm(forms.ModelForm):
    class Meta:
        model = RateLimitPolicy
        fields = tuple(f for f in RATELIMIT_FIELDS if f != "scope")


class RateLimitCreateForm(ActorForm):
    """Platform admins pick any tenant (or none: the platform default); tenant admins
    only set limits on their own keys (`api_key_id`), so they get no tenant field."""

    tenant = _tenant_field(required=False)
    api_key_id = forms.IntegerField(required=False, min_value=1, label="API key id",
                                    help_text="For scope 'api_key': one key only.")

    class Meta:
        model = RateLimitPolicy
        fields = ("tenant", *RATELIMIT_FIELDS)

    def __init__(self, *args: Any, actor: Principal, **kwargs: Any) -> None:
        super().__init__(*args, actor=actor, **kwargs)
        if not actor.can(Action.GOVERNANCE_MANAGE_ANY):
            del self.fields["tenant"]


class BreakerForm(forms.ModelForm):
    class Meta:
        model = BreakerPolicy
        fields = BREAKER_FIELDS


DEPLOYMENT_FIELDS = ("enabled", "max_batch_size", "max_wait_ms", "max_queue_depth",
                     "tenant_queue_share", "tenant_running_share", "max_output_tokens",
                     "max_tokens_policy",
                     "min_replicas", "max_replicas", "target_inflight",
                     "scale_up_delay_s", "scale_down_delay_s", "scale_to_zero_delay_s",
                     "max_queue_age_s")


class DeploymentForm(forms.ModelForm):
    """Batching, queue and autoscaling settings of a deployment."""

    class Meta:
        model = Deployment
        fields = DEPLOYMENT_FIELDS


class KeyForm(forms.Form):
    name = forms.CharField(max_length=100)
    role = forms.ChoiceField(choices=[("", "(your own role)"), *Role.choices], required=False,
                             help_text="A key cannot exceed your own role.")
    expires_at = forms.DateTimeField(required=False, help_text="UTC, e.g. 2027-01-31 12:00")
    allowed_models = forms.CharField(required=False, max_length=2000,
                                     help_text="Comma-separated; empty: every model.")
    priority = forms.IntegerField(required=False, min_value=0, max_value=9, initial=0)

    def clean_allowed_models(self) -> list[str] | None:
        raw = self.cleaned_data["allowed_models"].strip()
        return [m.strip() for m in raw.split(",") if m.strip()] if raw else None


class TenantForm(forms.Form):
    slug = forms.SlugField(max_length=64)
    name = forms.CharField(max_length=200)
    admin_username = forms.CharField(max_length=150, required=False,
                                     help_text="Optional: create the tenant's first admin.")
    admin_email = forms.EmailField(required=False)
    admin_password = forms.CharField(min_length=12, max_length=200, required=False,
                                     widget=forms.PasswordInput)

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        admin = [data.get(f) for f in ("admin_username", "admin_email", "admin_password")]
        if any(admin) and not all(admin):
            raise forms.ValidationError("Give the first admin's username, email and "
                                        "password, or none of them.")
        return data


class ToolPolicyForm(forms.Form):
    hosted_tools = forms.ChoiceField(
        choices=HostedTools.choices, label="Hosted tools",
        help_text="Tools the API's provider would run (web_search, code_interpreter, "
                  "Anthropic's server tools...), which this server cannot: drop them "
                  "from the request (named in the x-sluice-dropped-tools header and the "
                  "audit log) or refuse the request (400).")


class MemberEditForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)
    is_active = forms.BooleanField(required=False, label="Active")


class MemberForm(forms.Form):
    username = forms.CharField(max_length=150)
    email = forms.EmailField()
    password = forms.CharField(min_length=12, max_length=200, widget=forms.PasswordInput)
    role = forms.ChoiceField(choices=Role.choices)


class AuditFilterForm(forms.Form):
    since = forms.DateTimeField(required=False)
    until = forms.DateTimeField(required=False)
    actor = forms.CharField(required=False, max_length=300)
    action = forms.CharField(required=False, max_length=64)
    model = forms.CharField(required=False, max_length=100)
    status = forms.IntegerField(required=False, min_value=100, max_value=599)


class ExportForm(AuditFilterForm):
    format = forms.ChoiceField(choices=[("jsonl", "JSON lines"), ("csv", "CSV")])
