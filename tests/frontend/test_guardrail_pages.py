"""The admin UI's guardrail pages through Django's test client (the whole middleware
stack, the real services): who opens which, bad input refused inline with nothing
saved, a webhook's secret shown once, an edit and a deletion audited."""

from __future__ import annotations

from typing import Any

import pytest

from governance import audit
from governance.guardrail_models import GuardrailPolicy
from governance.models import AuditEvent
from tenants.roles import Role
from tests.conftest import Org, signed_in

PA, TA, DEV, AUD = Role.PLATFORM_ADMIN, Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR


@pytest.mark.django_db(transaction=True)
def test_each_role_opens_its_guardrail_pages_and_the_form_refuses_bad_input(
        ops: Org, alice: Org, settings: Any) -> None:
    settings.SLUICE_UPSTREAM_ALLOW_PRIVATE = True  # the webhook's URL: a loopback one
    for role, status in ((TA, 200), (AUD, 200), (DEV, 403)):
        assert signed_in(alice, role).get("/ui/guardrails").status_code == status, role
    assert signed_in(alice, AUD).get("/ui/guardrails/new").status_code == 403
    admin = signed_in(alice, TA)
    form = admin.get("/ui/guardrails/new").content.decode()
    assert "id_mandatory" not in form and "id_tenant_id" not in form  # platform admins'
    bad = admin.post("/ui/guardrails/new", {
        "name": "x", "guard": "words", "phase": "pre", "action": "block", "scope": "tenant",
        "config": '{"deny_regex": ["(a+)+$"]}', "timeout_ms": "1000", "on_error": "open"})
    assert bad.status_code == 422 and not GuardrailPolicy.objects.exists()
    made = admin.post("/ui/guardrails/new", {
        "name": "vendor", "guard": "webhook", "phase": "post", "action": "mask",
        "scope": "tenant", "config": '{"url": "http://127.0.0.1:9/guard"}',
        "timeout_ms": "500", "on_error": "closed", "enabled": "on"}, follow=True)
    page = made.content.decode()
    assert "Its webhook secret (shown once): whsec_" in page, page[-3000:]
    row = GuardrailPolicy.objects.get()
    listed = admin.get("/ui/guardrails").content.decode()
    assert "whsec_" not in listed and "vendor" in listed
    saved = admin.post(f"/ui/guardrails/{row.pk}", {
        "name": "vendor", "action": "flag", "timeout_ms": "500", "on_error": "open",
        "config": '{"url": "http://127.0.0.1:9/guard"}', "shadow": "on"})
    assert saved.status_code == 302
    row.refresh_from_db()
    assert (row.action, row.shadow, row.enabled, row.secret_sealed != "") == \
        ("flag", True, False, True)
    assert admin.post(f"/ui/guardrails/{row.pk}", {"delete": "1"}).status_code == 302
    assert not GuardrailPolicy.objects.exists()
    audit.drain()
    assert set(AuditEvent.objects.filter(target=f"guardrail:{row.pk}").values_list(
        "action", flat=True)) == {"guardrail.create", "guardrail.update", "guardrail.delete"}
