"""The admin UI's money pages through Django's test client (the whole middleware stack,
the real services): who opens which, a platform admin's price form with its bad input
refused inline, a deletion, and the spend CSV of a developer's own keys."""

from __future__ import annotations

from decimal import Decimal

import pytest

from governance import audit
from governance.models import AuditEvent, Price
from tenants.roles import Role
from tests.conftest import Org, signed_in

pytestmark = pytest.mark.django_db(transaction=True)
PA, TA, DEV, AUD = Role.PLATFORM_ADMIN, Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR


def test_each_role_opens_its_money_pages(ops: Org, alice: Org) -> None:
    allowed = {PA: ["/ui/spend", "/ui/budgets", "/ui/budgets/new", "/ui/prices",
                    "/ui/prices/new", "/ui/spend.csv"],
               TA: ["/ui/spend", "/ui/budgets", "/ui/budgets/new", "/ui/prices"],
               DEV: ["/ui/spend", "/ui/prices", "/ui/spend.csv"],
               AUD: ["/ui/spend", "/ui/budgets", "/ui/prices"]}
    refused = {TA: ["/ui/prices/new"], DEV: ["/ui/budgets", "/ui/budgets/new", "/ui/prices/new"],
               AUD: ["/ui/budgets/new", "/ui/prices/new"]}
    for role, urls in allowed.items():
        client = signed_in(ops if role == PA else alice, role)
        for url in urls:
            assert client.get(url).status_code == 200, (role, url)
        for url in refused.get(role, []):
            assert client.get(url).status_code == 403, (role, url)
    page = signed_in(alice, AUD).get("/ui/budgets").content.decode()
    assert "New budget" not in page, "auditors read budgets, and get no form"


def test_a_platform_admin_adds_and_deletes_a_price_version(ops: Org, alice: Org) -> None:
    admin = signed_in(ops, PA)
    bad = admin.post("/ui/prices/new", {"model": "echo", "input_per_mtok_usd": "-1",
                                        "output_per_mtok_usd": "1"})
    assert bad.status_code == 422 and Price.objects.count() == 0
    made = admin.post("/ui/prices/new", {"model": "echo", "input_per_mtok_usd": "0.15",
                                         "output_per_mtok_usd": "0.6"})
    assert made.status_code == 302, made.content.decode()[-2000:]
    price = Price.objects.get()
    assert (price.input_per_mtok_usd, price.output_per_mtok_usd) == (Decimal("0.15"),
                                                                     Decimal("0.6"))
    listed = signed_in(alice, DEV).get("/ui/prices").content.decode()
    assert "0.150000" in listed and "Delete" not in listed
    assert signed_in(alice, DEV).post("/ui/prices", {"price_id": price.pk,
                                                     "delete": "1"}).status_code == 403
    assert admin.post("/ui/prices", {"price_id": "x", "delete": "1"}).status_code == 404
    assert admin.post("/ui/prices", {"price_id": price.pk, "delete": "1"}).status_code == 302
    assert not Price.objects.exists()
    audit.drain()
    assert set(AuditEvent.objects.filter(target=f"price:{price.pk}").values_list(
        "action", flat=True)) == {"price.create", "price.delete"}


def test_the_spend_csv_is_a_developers_own(alice: Org) -> None:
    csv_text = signed_in(alice, DEV).get("/ui/spend.csv?days=7&group_by=model").content
    assert csv_text.decode().splitlines()[0].startswith("start,model,calls,errors")
