"""Admin UI pages for money: spend over time with its breakdown and a CSV export (read
from the rollups only, governance/rollups.py), and budgets with their burn-down, the
alerts their window has reached, and their form. The management API's selectors and
services decide what each role sees and may change: tenant admins and auditors see the
tenant's spend and budgets, developers their keys' spend; tenant admins set their
members' and keys' budgets, platform admins tenants'."""

from __future__ import annotations

import csv
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django import forms
from django.http import HttpRequest, HttpResponse

from frontend.paging import keyset
from frontend.session import page
from frontend.views import _deleted, _form_view, _page
from governance import live
from governance import selectors as gov
from governance import services as gov_services
from governance.models import Budget, BudgetScope, BudgetWindow, Price
from governance.services import PRICE_FIELDS
from sluice.errors import NotFound
from tenants.principal import Principal
from tenants.roles import Action

SPEND_ROLES = (Action.GOVERNANCE_MANAGE, Action.AUDIT_READ, Action.APIKEY_MANAGE_OWN)
BREAKDOWN_ROWS = 50


class SpendForm(forms.Form):
    days = forms.TypedChoiceField(choices=[(7, "7 days"), (30, "30 days"), (90, "90 days")],
                                  coerce=int, initial=30, required=False)
    group_by = forms.ChoiceField(choices=[("key", "API key"), ("member", "member"),
                                          ("model", "model")], initial="key", required=False)
    granularity = forms.ChoiceField(choices=[("day", "day"), ("hour", "hour")],
                                    initial="day", required=False)

    def choice(self) -> tuple[int, str, str]:
        data = self.cleaned_data if self.is_valid() else {}
        granularity = data.get("granularity") or "day"
        days = data.get("days") or 30
        return (min(days, 31) if granularity == "hour" else days,
                data.get("group_by") or "key", granularity)


def _window(days: int) -> tuple[datetime, datetime]:
    now = datetime.now(UTC)
    return now - timedelta(days=days), now + timedelta(hours=1)


@page(*SPEND_ROLES)
def spend(request: HttpRequest, actor: Principal) -> HttpResponse:
    """Cost and calls per period (a uPlot chart, drawn by spend.js from the JSON the page
    carries), the groups that spent most, and the budgets' burn-down."""
    form = SpendForm(request.GET or None)
    days, group_by, granularity = form.choice()
    since, until = _window(days)
    series = gov.spend(actor=actor, granularity=granularity, since=since, until=until,
                       latency=False)
    groups = gov.spend(actor=actor, granularity=granularity, since=since, until=until,
                       group_by=group_by, latency=False, per_period=False)
    groups.sort(key=lambda r: Decimal(r["cost_usd"]), reverse=True)
    chart = {"from": int(since.timestamp()), "to": int(until.timestamp()),
             "t": [int(r["start"].timestamp()) for r in series],
             "cost": [float(r["cost_usd"]) for r in series],
             "calls": [r["calls"] for r in series]}
    total = sum((Decimal(r["cost_usd"]) for r in series), Decimal(0))
    return _page(request, actor, "spend.html", form=form, chart=chart, total=total,
                 calls=sum(r["calls"] for r in series), groups=groups[:BREAKDOWN_ROWS],
                 more=max(0, len(groups) - BREAKDOWN_ROWS), group_by=group_by,
                 days=days, granularity=granularity, budgets=_budgets(actor),
                 can_edit=actor.can(Action.GOVERNANCE_MANAGE),
                 query=request.GET.urlencode(),
                 own_only=not any(actor.can(a) for a in SPEND_ROLES[:2]))


@page(*SPEND_ROLES)
def spend_csv(request: HttpRequest, actor: Principal) -> HttpResponse:
    """The page's range per period and group, as CSV."""
    days, group_by, granularity = SpendForm(request.GET or None).choice()
    since, until = _window(days)
    rows = gov.spend(actor=actor, granularity=granularity, since=since, until=until,
                     group_by=group_by, latency=True)
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="spend-{granularity}.csv"'
    columns = ["start", {"key": "key_prefix", "member": "member_id", "model": "model"}[
        group_by], "calls", "errors", "prompt_tokens", "completion_tokens", "cached_tokens",
        "cost_usd", "latency_p50_ms", "latency_p95_ms"]
    out = csv.writer(response)
    out.writerow(columns)
    for row in rows:
        out.writerow([_cell(row.get(c)) for c in columns])
    return response


def _cell(value: Any) -> Any:
    """A spreadsheet never reads a cell as a formula (CSV injection)."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@"):
        return "'" + value
    return "" if value is None else value


def _budgets(actor: Principal) -> list[tuple[Budget, dict[str, Any], int]]:
    """The budgets the actor may see, each with its window's use and its spend as a
    whole percentage of the limit (the burn-down bar)."""
    if not (actor.can(Action.GOVERNANCE_MANAGE) or actor.can(Action.AUDIT_READ)):
        return []
    out = []
    for budget in gov.budget_list(actor=actor)[:100]:
        use = live.budget_use(budget)
        pct = (int(Decimal(use["spent_usd"]) * 100 / budget.limit_usd)
               if budget.limit_usd else 100)
        out.append((budget, use, min(pct, 100)))
    return out


@page(Action.GOVERNANCE_MANAGE, Action.AUDIT_READ)
def budgets(request: HttpRequest, actor: Principal) -> HttpResponse:
    """Every role that reads budgets sees them; those that set them get the form."""
    return _page(request, actor, "budgets.html", budgets=_budgets(actor),
                 can_edit=actor.can(Action.GOVERNANCE_MANAGE))


class BudgetForm(forms.Form):
    limit_usd = forms.DecimalField(min_value=Decimal(0), max_digits=16, decimal_places=6,
                                   label="Limit (US$)")
    alert_at = forms.CharField(max_length=60, required=False, initial="50, 80, 100",
                               help_text="Percentages of the limit that alert once a window.")
    fallback_model = forms.CharField(max_length=100, required=False,
                                     help_text="A cheaper model or alias for the calls the "
                                               "budget refuses (empty: refuse them).")

    def clean_alert_at(self) -> list[int]:
        try:
            pcts = [int(p) for p in self.cleaned_data["alert_at"].replace(",", " ").split()]
        except ValueError:
            raise forms.ValidationError("Whole percentages, e.g. 50, 80, 100.") from None
        if len(pcts) > 10 or any(not 1 <= p <= 100 for p in pcts):
            raise forms.ValidationError("At most ten percentages from 1 to 100.")
        return pcts


class BudgetCreateForm(BudgetForm):
    scope = forms.ChoiceField(choices=BudgetScope.choices, initial=BudgetScope.MEMBER)
    tenant_id = forms.IntegerField(min_value=1, required=False, label="Tenant id",
                                   help_text="Platform admins: the tenant (default: yours).")
    member_id = forms.IntegerField(min_value=1, required=False, label="Member id",
                                   help_text="For scope 'member'.")
    key_id = forms.IntegerField(min_value=1, required=False, label="API key id",
                                help_text="For scope 'key'.")
    model = forms.CharField(max_length=100, required=False,
                            help_text="One model or alias only (empty: every model).")
    window = forms.ChoiceField(choices=BudgetWindow.choices, initial=BudgetWindow.MONTH)

    field_order = ["scope", "tenant_id", "member_id", "key_id", "model", "window",
                   "limit_usd", "alert_at", "fallback_model"]

    def __init__(self, *args: Any, actor: Principal, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not actor.can(Action.GOVERNANCE_MANAGE_ANY):
            del self.fields["tenant_id"]


def _given(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if v not in (None, "") or k == "fallback_model"}


@page(Action.GOVERNANCE_MANAGE)
def budget_new(request: HttpRequest, actor: Principal) -> HttpResponse:
    form = BudgetCreateForm(request.POST or None, actor=actor)
    return _form_view(request, actor, form, title="New budget",
                      save=lambda data: gov_services.budget_create(actor=actor, **_given(data)),
                      done="/ui/budgets", saved="Budget created.")


@page(Action.GOVERNANCE_MANAGE)
def budget_edit(request: HttpRequest, actor: Principal, budget_id: int) -> HttpResponse:
    deleted = _deleted(request, lambda: gov_services.budget_delete(actor=actor,
                                                                   budget_id=budget_id),
                       done="/ui/budgets", what="Budget")
    if deleted is not None:
        return deleted
    budget = gov.budget_get(actor=actor, budget_id=budget_id)
    initial = {"limit_usd": budget.limit_usd, "fallback_model": budget.fallback_model,
               "alert_at": ", ".join(str(p) for p in budget.alert_at or ())}
    form = BudgetForm(request.POST or None, initial=initial)  # limit_usd is required
    return _form_view(request, actor, form,
                      title=f"Budget #{budget_id}: {budget.scope} per {budget.window}",
                      save=lambda data: gov_services.budget_update(
                          actor=actor, budget_id=budget_id, **data),
                      done="/ui/budgets", saved="Budget saved.", deletable=True)


class PriceForm(forms.ModelForm):
    class Meta:
        model = Price
        fields = PRICE_FIELDS
        help_texts = {"model": "A deployment or alias name.",
                      "valid_from": "From when (UTC; default now). Versions are never "
                                    "edited: a new price is a new version."}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["valid_from"].required = False
        self.fields["valid_from"].show_hidden_initial = False


@page(Action.MODEL_LIST)
def prices(request: HttpRequest, actor: Principal) -> HttpResponse:
    """Every price version, newest first (every role reads them); platform admins add
    and delete versions."""
    if request.method == "POST":
        price_id = request.POST.get("price_id", "")
        if not price_id.isdigit() or len(price_id) > 18:
            raise NotFound("No such price.")
        done = _deleted(request, lambda: gov_services.price_delete(
            actor=actor, price_id=int(price_id)), done="/ui/prices", what="Price")
        if done is not None:
            return done
    rows = keyset(request, gov.price_list(actor=actor), newest_first=True)
    return _page(request, actor, "prices.html", page=rows,
                 can_edit=actor.can(Action.GOVERNANCE_MANAGE_ANY))


@page(Action.GOVERNANCE_MANAGE_ANY)
def price_new(request: HttpRequest, actor: Principal) -> HttpResponse:
    form = PriceForm(request.POST or None)
    return _form_view(request, actor, form, title="New price version",
                      save=lambda data: gov_services.price_create(actor=actor, **data),
                      done="/ui/prices", saved="Price added.")
