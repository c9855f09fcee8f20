"""The UI's Content-Security-Policy in a real headless Chromium: the policy is enforced
(an injected inline script does not run, and is reported), and no page the UI serves
trips it: the live dashboard still streams (SSE) and draws its SVG charts, and the
audit export's progress polling still works."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
from openai import OpenAI

from tenants.roles import Role
from tests.conftest import Org, make_org
from tests.frontend.test_browser import browser, chat, open_as  # noqa: F401
from tests.streaming.conftest import Live

pytestmark = pytest.mark.slow

if TYPE_CHECKING:  # test_browser imports playwright where chromium exists
    from playwright.sync_api import Page

# Every violation the page reports, and every console message that says it blocked one.
RECORD = """
window.__csp = [];
document.addEventListener("securitypolicyviolation",
    (e) => window.__csp.push(e.violatedDirective + " " + e.blockedURI));
"""


def watched(page: Page) -> list[str]:
    page.context.add_init_script(RECORD)
    console: list[str] = []
    page.on("console", lambda m: console.append(m.text)
            if "Content Security Policy" in m.text else None)
    return console


def violations(page: Page, console: list[str]) -> list[str]:
    return [*page.evaluate("window.__csp || []"), *console]


def test_the_ui_works_under_its_csp_and_the_policy_is_enforced(
        live: Live, open_as: Callable[[Org, Role], Page]) -> None:  # noqa: F811
    # Given a platform admin in the browser, and calls that move the dashboard
    ops = make_org("ops", [Role.PLATFORM_ADMIN])
    acme = make_org("acme", [Role.DEVELOPER])
    client = OpenAI(base_url=live.base_url, api_key=acme.keys[Role.DEVELOPER], max_retries=0)
    page = open_as(ops, Role.PLATFORM_ADMIN)
    console = watched(page)
    # When they open the dashboard
    response = page.goto("/ui/dashboard")
    assert response is not None
    assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
    # Then the stream connects and the SVG charts draw, with the policy on
    page.locator("#live-status").filter(has_text="live").wait_for(timeout=10_000)
    for _ in range(5):
        chat(client)
    card = page.locator("section.card[data-deployment=echo]")
    card.locator("figure[data-series=qps] polyline").first.wait_for(timeout=10_000)
    page.wait_for_function(
        "document.querySelector('section.card[data-deployment=echo] "
        "figure[data-series=qps] polyline').getAttribute('points').split(' ').length > 2",
        timeout=15_000)
    # and the other pages (forms, tables, the export's polling) trip nothing either
    for url in ("/ui/limits/new", "/ui/quotas/new", "/ui/deployments/echo/breaker",
                "/ui/audit", "/ui/keys", "/ui/tenants"):
        page.goto(url)
        page.wait_for_load_state("load")
    page.goto("/ui/audit")
    with page.expect_response(lambda r: r.url.endswith("?format=json") and r.ok):
        page.click("button:has-text('Export')")  # the export page polls its status
    assert violations(page, console) == []
    # And an inline script injected into a page does not run, and is reported
    page.goto("/ui/keys")
    page.evaluate("""() => { const s = document.createElement("script");
        s.textContent = "window.__ran = true"; document.body.appendChild(s); }""")
    page.wait_for_function("window.__csp.length > 0", timeout=5_000)
    assert page.evaluate("window.__ran === undefined")
    assert any("script-src" in v for v in violations(page, console))
