"""Money in the admin UI, in a real headless Chromium: a tenant admin makes a budget
with the form (a bad limit is refused inline), calls are priced and rolled up, and the
spend page draws its uPlot chart under the CSP with the breakdown, the budget's
burn-down and its alert banner; the CSV holds the same cost. Screenshots: spend.png,
budget-form.png."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING

import pytest
from openai import OpenAI

from governance import audit, rollups
from governance import cache as policy_cache
from governance.models import Budget, Price
from tenants.roles import Role
from tests.conftest import Org, make_org
from tests.frontend.test_browser import browser, open_as, shot  # noqa: F401
from tests.frontend.test_csp_browser import violations, watched
from tests.streaming.conftest import Live

pytestmark = pytest.mark.slow

if TYPE_CHECKING:
    from playwright.sync_api import Page


def test_a_budget_made_in_the_form_and_the_spend_page_with_its_chart(
        live: Live, open_as: Callable[[Org, Role], Page]) -> None:  # noqa: F811
    Price.objects.create(model="echo", input_per_mtok_usd=1000, output_per_mtok_usd=1000,
                         valid_from=datetime.now(UTC) - timedelta(days=1))
    org = make_org("acme", [Role.TENANT_ADMIN, Role.DEVELOPER])
    page = open_as(org, Role.TENANT_ADMIN)
    console = watched(page)
    page.goto("/ui/budgets/new")
    page.select_option("#id_scope", "key")
    page.fill("#id_key_id", str(org.key_rows[Role.DEVELOPER].pk))
    page.fill("#id_limit_usd", "-1")
    page.click("button[type=submit]")
    assert page.locator(".field.invalid, .errors, .error").count() > 0
    assert Budget.objects.count() == 0
    page.fill("#id_limit_usd", "0.5")
    page.fill("#id_alert_at", "10, 90")
    shot(page, "budget-form")
    page.click("button[type=submit]")
    page.wait_for_url("**/ui/budgets")
    budget = Budget.objects.get()
    assert (budget.scope, budget.limit_usd, budget.alert_at) == ("key", Decimal("0.5"),
                                                                 [10, 90])
    policy_cache.clear()
    client = OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER], max_retries=0)
    spent = Decimal(0)
    for text in ("a first call", "a second, longer call", "three"):
        raw = client.chat.completions.with_raw_response.create(
            model="echo", max_tokens=16, messages=[{"role": "user", "content": text}])
        spent += Decimal(raw.headers["x-sluice-cost-usd"])
    audit.drain()
    rollups.roll()
    page.goto("/ui/spend?days=7&group_by=key&granularity=hour")
    page.wait_for_selector("#spend-chart.drawn canvas")
    assert page.locator(".u-legend").count() == 1, "uPlot drew its chart and legend"
    row = page.locator("table tr", has_text=org.key_rows[Role.DEVELOPER].prefix)
    assert str(spent) in row.inner_text()
    assert page.locator("progress").count() == 1
    assert "has reached 10%" in page.locator(".flash.warn").inner_text()
    assert violations(page, console) == []
    shot(page, "spend")
    csv_text = page.request.get("/ui/spend.csv?days=7&group_by=key&granularity=hour").text()
    assert org.key_rows[Role.DEVELOPER].prefix in csv_text
    assert sum(Decimal(line.split(",")[7]) for line in csv_text.splitlines()[1:]) == spent
