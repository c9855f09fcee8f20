"""Guardrails in the admin UI, in a real headless Chromium: a tenant admin makes a
masking policy with the form (under the CSP), and the next call through the official
client comes back masked. Screenshot: guardrails.png."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
from openai import OpenAI

from governance import cache as policy_cache
from tenants.roles import Role
from tests.conftest import Org, make_org
from tests.frontend.test_browser import browser, open_as, shot  # noqa: F401
from tests.frontend.test_csp_browser import violations, watched
from tests.streaming.conftest import Live

if TYPE_CHECKING:
    from playwright.sync_api import Page


@pytest.mark.slow
def test_a_policy_made_in_the_browser_masks_the_next_call(
        live: Live, open_as: Callable[[Org, Role], Page]) -> None:  # noqa: F811
    org = make_org("acme", [Role.TENANT_ADMIN, Role.DEVELOPER])
    page = open_as(org, Role.TENANT_ADMIN)
    console = watched(page)
    page.goto("/ui/guardrails/new")
    page.fill("#id_name", "mask-pii")
    page.select_option("#id_guard", "pii")
    page.select_option("#id_phase", "post")
    page.select_option("#id_action", "mask")
    page.fill("#id_categories", "email, phone")
    page.click("button[type=submit]")
    page.wait_for_url("**/ui/guardrails")
    assert "mask-pii" in page.locator("table").inner_text()
    assert violations(page, console) == []
    shot(page, "guardrails")
    policy_cache.clear()
    client = OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER], max_retries=0)
    reply = client.chat.completions.create(model="echo", messages=[
        {"role": "user", "content": "write to jane.doe@example.com"}])
    assert reply.choices[0].message.content == "write to [EMAIL]"
