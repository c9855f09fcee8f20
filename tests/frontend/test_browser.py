"""The admin UI in a real headless Chromium (Debian's, driven by Playwright; nothing is
downloaded at test time) against the live server: changes made in the browser govern
the very next API calls, an auditor finds an event without seeing its secrets, a
developer cannot reach admin pages, and the dashboard updates itself. Screenshots of
the main pages are test artifacts in test-artifacts/screenshots/; to refresh the
README's copies: `SLUICE_SCREENSHOTS=docs/screenshots ./dev.sh test tests/frontend`."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import APIStatusError, OpenAI

from governance import audit
from governance.models import BreakerPolicy, Quota
from tenants.roles import Role
from tests.conftest import PASSWORD, REPO, Org, eventually, make_org
from tests.streaming.conftest import Live

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = Path(os.environ.get("SLUICE_SCREENSHOTS", REPO / "test-artifacts" / "screenshots"))

if CHROMIUM is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI needs Debian's chromium (dev.sh installs it)")
    pytest.skip("no chromium on this machine (apt-get install chromium)",
                allow_module_level=True)

from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: E402


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # Playwright's sync API keeps an event loop running in this thread; Django would
    # take the test's own (synchronous) database calls for calls from async code.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                        args=["--no-sandbox", "--disable-dev-shm-usage"])
            yield browser
            browser.close()
    finally:
        del os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"]


@pytest.fixture
def open_as(browser: Browser, live: Live) -> Iterator[Callable[[Org, Role], Page]]:
    base = live.base_url.removesuffix("/v1")
    contexts = []

    def sign_in(org: Org, role: Role) -> Page:
        context = browser.new_context(base_url=base, viewport={"width": 1400, "height": 900})
        contexts.append(context)
        page = context.new_page()
        page.goto("/ui/login")
        page.fill("#id_username", f"{org.tenant.slug}-{role}")
        page.fill("#id_password", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url("**/ui/**")
        return page

    yield sign_in
    for context in contexts:
        context.close()


def shot(page: Page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def refused(client: OpenAI, status: int) -> APIStatusError | None:
    """The error of a chat call refused with `status`, None if it went through."""
    try:
        chat(client)
    except APIStatusError as exc:
        return exc if exc.status_code == status else None
    return None


def chat(client: OpenAI, text: str = "hello") -> Any:
    return client.chat.completions.create(model="echo", max_tokens=4,
                                          messages=[{"role": "user", "content": text}])


def test_admin_changes_a_quota_and_a_breaker_and_the_next_calls_obey(
        live: Live, open_as: Callable[[Org, Role], Page]) -> None:
    ops = make_org("ops", [Role.PLATFORM_ADMIN])
    acme = make_org("acme", [Role.DEVELOPER])
    client = OpenAI(base_url=live.base_url, api_key=acme.keys[Role.DEVELOPER], max_retries=0)
    chat(client)
    page = open_as(ops, Role.PLATFORM_ADMIN)

    # A quota of 2 requests a day on echo for acme: the third call is refused.
    page.goto("/ui/quotas/new")
    page.select_option("#id_tenant", label="acme (Acme Inc)")
    page.fill("#id_model", "echo")
    page.fill("#id_max_requests", "2")
    shot(page, "quota-form")
    page.click("text=Save")
    expect(page.locator(".flash")).to_contain_text("Quota created.")
    assert Quota.objects.get(tenant=acme.tenant).max_requests == 2
    shot(page, "quotas")

    error = eventually(lambda: refused(client, 429), 6)
    assert error is not None and error.body["code"] == "quota_exceeded", error

    # The memory guard at 1% of memory with "reject": every echo worker leaves the
    # rotation at its next heartbeat, and calls are refused with 503 memory_pressure.
    other = make_org("other", [Role.DEVELOPER])
    client = OpenAI(base_url=live.base_url, api_key=other.keys[Role.DEVELOPER], max_retries=0)
    chat(client)
    page.goto("/ui/deployments/echo/breaker")
    page.fill("#id_memory_high", "0.01")
    page.fill("#id_memory_low", "0.005")
    page.fill("#id_memory_hold_s", "60")
    page.select_option("#id_degrade_mode", "reject")
    page.click("text=Save")
    expect(page.locator(".flash")).to_contain_text("Breaker thresholds saved.")
    assert BreakerPolicy.objects.get(deployment__name="echo").memory_high == 0.01
    shot(page, "breaker")

    error = eventually(lambda: refused(client, 503), 6)
    assert error is not None and error.body["code"] == "memory_pressure", error


def test_bad_input_is_shown_inline_in_the_browser(
        live: Live, open_as: Callable[[Org, Role], Page]) -> None:
    ops = make_org("ops", [Role.PLATFORM_ADMIN])
    page = open_as(ops, Role.PLATFORM_ADMIN)
    page.goto("/ui/deployments/echo/breaker")
    page.fill("#id_memory_high", "0.5")
    page.fill("#id_memory_low", "0.9")
    page.click("text=Save")
    expect(page.locator(".errors")).to_contain_text("memory_low must be below memory_high.")
    page.goto("/ui/deployments/echo")
    page.fill("#id_min_replicas", "5")
    page.fill("#id_max_replicas", "2")
    page.click("text=Save")
    expect(page.locator("p.error[data-field=min_replicas]")).to_contain_text(
        "must not exceed max_replicas")
    assert not BreakerPolicy.objects.filter(deployment__name="echo").exists()


def test_an_auditor_finds_an_event_and_cannot_see_its_secrets(
        live: Live, open_as: Callable[[Org, Role], Page], celery_worker: None) -> None:
    acme = make_org("acme", [Role.DEVELOPER, Role.AUDITOR])
    client = OpenAI(base_url=live.base_url, api_key=acme.keys[Role.DEVELOPER], max_retries=0)
    card, email = "4111 1111 1111 1111", "jane.doe@example.com"
    chat(client, f"charge {card} and mail {email} <b>bold</b>")
    chat(client, "an ordinary question")
    audit.drain()
    page = open_as(acme, Role.AUDITOR)
    page.goto("/ui/audit")
    page.fill("#id_action", "chat.completions")
    page.fill("#id_model", "echo")
    page.click("text=Search")
    rows = page.locator("table.events tr")
    expect(rows).to_have_count(3)  # the header and the two calls
    shot(page, "audit")
    page.locator("table.events a").last.click()  # the oldest: the one with the card
    excerpt = page.locator("pre.excerpt").first
    expect(excerpt).to_contain_text("[CARD]")
    expect(excerpt).to_contain_text("[EMAIL]")
    expect(excerpt).to_contain_text("<b>bold</b>")  # shown as text, not markup
    html = page.content()
    assert card not in html and email not in html and "<b>bold</b>" not in html
    shot(page, "audit-event")

    page.goto("/ui/audit/verify")
    page.click("text=Verify now")
    expect(page.locator("#verify-result")).to_contain_text("intact")

    page.goto("/ui/audit")
    page.select_option("#id_export-format", "csv")
    page.click("button:has-text('Export')")
    expect(page.locator("#export-link")).to_be_visible(timeout=20_000)
    expect(page.locator("#export-status")).to_contain_text("done")
    shot(page, "audit-export")
    with page.expect_download() as download:
        page.click("#export-link a")
    text = Path(download.value.path()).read_text()
    assert "[CARD]" in text and card not in text


def test_a_developer_cannot_open_admin_pages(
        live: Live, open_as: Callable[[Org, Role], Page]) -> None:
    acme = make_org("acme", [Role.DEVELOPER])
    page = open_as(acme, Role.DEVELOPER)
    nav = page.locator("header nav")
    for label in ("Quotas", "Deployments", "Tenants", "Audit log", "Members"):
        expect(nav).not_to_contain_text(label)
    for url in ("/ui/quotas", "/ui/deployments/echo/breaker", "/ui/tenants", "/ui/audit",
                "/ui/members"):
        response = page.goto(url)
        assert response is not None and response.status == 403, url
        expect(page.locator(".errors")).to_contain_text("may not open this page")
    page.goto("/ui/keys/new")
    page.fill("#id_name", "my laptop")
    page.click("text=Save")
    secret = page.locator("#secret").inner_text()
    assert secret.startswith("sk-sluice-")
    shot(page, "key-created")
    page.goto("/ui/keys")
    assert secret not in page.content()
    shot(page, "keys")


def test_the_dashboard_updates_without_a_reload(
        live: Live, open_as: Callable[[Org, Role], Page]) -> None:
    ops = make_org("ops", [Role.PLATFORM_ADMIN])
    acme = make_org("acme", [Role.DEVELOPER])
    client = OpenAI(base_url=live.base_url, api_key=acme.keys[Role.DEVELOPER], max_retries=0)
    page = open_as(ops, Role.PLATFORM_ADMIN)
    page.goto("/ui/dashboard")
    expect(page.locator("#live-status")).to_have_text("live", timeout=10_000)
    card = page.locator("section.card[data-deployment=echo]")
    expect(card).to_be_visible()
    for _ in range(30):
        chat(client)
    # The figures move while the page stays loaded (no navigation happened).
    expect(card.locator(".facts")).not_to_contain_text(" 0 QPS", timeout=15_000)
    points = card.locator("figure[data-series=qps] polyline")
    assert len(points.first.get_attribute("points").split()) > 2
    shot(page, "dashboard")
    page.goto("/ui/deployments")
    shot(page, "deployments")
    page.goto("/ui/deployments/echo")
    shot(page, "deployment-scaling")
