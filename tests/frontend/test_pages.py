"""The admin UI's pages through Django's test client: who may open what (the API's RBAC
table), every form refusing bad input inline with nothing saved, CSRF, escaping, the
one-time key secret, and lists that stay fast with 100,000 keys."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from governance.models import BreakerPolicy, Quota, RateLimitPolicy, RateLimitScope
from inference.models import Deployment
from tenants.models import ApiKey, Member, Tenant
from tenants.roles import Role
from tests.conftest import PASSWORD, Org, signed_in

pytestmark = [pytest.mark.django_db, pytest.mark.cluster]



def test_sign_in_refuses_a_wrong_password_inline() -> None:
    response = Client().post("/ui/login", {"username": "nobody", "password": "wrong"})
    assert response.status_code == 401
    assert b"Incorrect username or password." in response.content


def test_pages_need_a_session() -> None:
    response = Client().get("/ui/quotas")
    assert response.status_code == 302 and response["Location"].startswith("/ui/login?next=")


ADMIN_PAGES = ["/ui/tenants", "/ui/tenants/new", "/ui/deployments", "/ui/quotas/new",
               "/ui/deployments/echo", "/ui/deployments/echo/breaker"]


@pytest.mark.parametrize("role", [Role.DEVELOPER, Role.AUDITOR, Role.TENANT_ADMIN])
def test_only_platform_admins_open_platform_pages(alice: Org, role: Role) -> None:
    Deployment.objects.create(name="echo", runtime="echo")
    client = signed_in(alice, role)
    for url in ADMIN_PAGES:
        response = client.get(url)
        assert response.status_code == 403, url
        assert b"may not open this page" in response.content


def test_each_role_sees_its_own_pages(ops: Org, alice: Org) -> None:
    Deployment.objects.create(name="echo", runtime="echo")
    pages = [
        (ops, Role.PLATFORM_ADMIN, [*ADMIN_PAGES, "/ui/dashboard", "/ui/limits",
                                    "/ui/members", "/ui/keys", "/ui/audit"]),
        (alice, Role.TENANT_ADMIN, ["/ui/limits", "/ui/members", "/ui/keys", "/ui/audit",
                                    "/ui/usage", "/ui/dashboard", "/ui/quotas"]),
        (alice, Role.DEVELOPER, ["/ui/keys", "/ui/usage", "/ui/conversations",
                                 "/ui/dashboard"]),
        (alice, Role.AUDITOR, ["/ui/audit", "/ui/audit/verify", "/ui/keys"]),
    ]
    for org, role, urls in pages:
        client = signed_in(org, role)
        for url in urls:
            assert client.get(url).status_code == 200, (role, url)
    assert signed_in(alice, Role.DEVELOPER).get("/ui/audit").status_code == 403
    assert signed_in(alice, Role.DEVELOPER).get("/ui/quotas").status_code == 403
    assert signed_in(alice, Role.AUDITOR).get("/ui/members").status_code == 403


def test_the_top_bar_names_the_person_and_their_tenant(alice: Org) -> None:
    page = signed_in(alice, Role.DEVELOPER).get("/ui/keys").content.decode()
    who = page.split('<div class="who"', 1)[1].split("</div>", 1)[0]
    assert f">alice-{Role.DEVELOPER} · developer · alice" in who, who
    assert ">member:" not in who


def test_tenant_admins_read_their_quotas_and_platform_admins_set_them(ops: Org, alice: Org,
                                                                      bob: Org) -> None:
    mine = Quota.objects.create(tenant=alice.tenant, model="echo", max_tokens=1000)
    Quota.objects.create(tenant=bob.tenant, model="echo", max_tokens=7777)
    page = signed_in(alice, Role.TENANT_ADMIN).get("/ui/quotas").content.decode()
    assert "/ 1000" in page and "7777" not in page  # their own tenant's only
    assert "/ui/quotas/new" not in page and f"/ui/quotas/{mine.pk}" not in page
    admin = signed_in(ops, Role.PLATFORM_ADMIN).get("/ui/quotas").content.decode()
    assert "7777" in admin and f"/ui/quotas/{mine.pk}" in admin


def _counts() -> tuple[int, ...]:
    return (Quota.objects.count(), RateLimitPolicy.objects.count(), Member.objects.count(),
            ApiKey.objects.count(), Tenant.objects.count())


BAD: list[tuple[Role, str, Callable[[Org], dict[str, Any]], str]] = [
    (Role.PLATFORM_ADMIN, "/ui/quotas/new",
     lambda o: {"tenant": o.tenant.pk, "period": "day", "window": "calendar"},
     "Set max_requests, max_tokens, max_concurrent or a mix."),
    (Role.PLATFORM_ADMIN, "/ui/quotas/new",
     lambda o: {"tenant": o.tenant.pk, "period": "day", "window": "calendar",
                "max_tokens": "-5"}, "greater than or equal to"),
    (Role.PLATFORM_ADMIN, "/ui/quotas/new",
     lambda o: {"tenant": "999999", "period": "day", "window": "calendar", "max_tokens": "5"},
     "Select a valid choice"),
    (Role.PLATFORM_ADMIN, "/ui/limits/new",
     lambda o: {"scope": "tenant", "tenant": o.tenant.pk, "requests_per_minute": "-1",
                "qps_ref": "1000", "qps_min": "0.5", "qps_max": "2", "p99_target_ms": "200",
                "p99_slope": "0.01", "floor": "0.3", "window_s": "60"},
     "greater than or equal to"),
    (Role.PLATFORM_ADMIN, "/ui/limits/new",
     lambda o: {"scope": "tenant", "tenant": o.tenant.pk, "requests_per_minute": "10",
                "qps_ref": "1000", "qps_min": "3", "qps_max": "2", "p99_target_ms": "200",
                "p99_slope": "0.01", "floor": "0.3", "window_s": "60"},
     "qps_min must not exceed qps_max."),
    (Role.TENANT_ADMIN, "/ui/limits/new",
     lambda o: {"scope": "tenant", "requests_per_minute": "10", "qps_ref": "1000",
                "qps_min": "0.5", "qps_max": "2", "p99_target_ms": "200", "p99_slope": "0.01",
                "floor": "0.3", "window_s": "60"},
     "Tenant admins may only set limits on their own API keys"),
    (Role.TENANT_ADMIN, "/ui/members/new",
     lambda o: {"username": "x", "email": "not-an-email", "password": "long enough pw",
                "role": "developer"}, "Enter a valid email address."),
    (Role.TENANT_ADMIN, "/ui/members/new",
     lambda o: {"username": "x", "email": "x@example.com", "password": "long enough pw",
                "role": "platform_admin"}, "cannot grant the role"),
    (Role.DEVELOPER, "/ui/keys/new", lambda o: {"name": ""}, "This field is required."),
    (Role.DEVELOPER, "/ui/keys/new",
     lambda o: {"name": "k", "expires_at": "2001-01-01 00:00"},
     "expires_at must be in the future."),
    (Role.DEVELOPER, "/ui/keys/new", lambda o: {"name": "k", "priority": "3"},
     "Only tenant admins may create priority keys."),
    (Role.DEVELOPER, "/ui/keys/new", lambda o: {"name": "k", "role": "tenant_admin"},
     "cannot grant the role"),
    (Role.AUDITOR, "/ui/audit/exports/new", lambda o: {"export-format": "xml"},
     "Select a valid choice"),
    (Role.PLATFORM_ADMIN, "/ui/tenants/new", lambda o: {"slug": "alice", "name": "Again"},
     "A tenant with that slug exists."),
    (Role.PLATFORM_ADMIN, "/ui/tenants/new",
     lambda o: {"slug": "new-one", "name": "New", "admin_username": "boss"},
     "or none of them"),
    (Role.PLATFORM_ADMIN, "/ui/tenants/new", lambda o: {"slug": "bad slug!", "name": "x"},
     "Enter a valid"),
]


@pytest.mark.parametrize(("role", "url", "body", "message"), BAD,
                         ids=[f"{u}:{m[:24]}" for _, u, _, m in BAD])
def test_bad_input_in_every_form_is_an_inline_error_and_saves_nothing(
        ops: Org, alice: Org, role: Role, url: str, body: Callable[[Org], dict[str, Any]],
        message: str) -> None:
    org = ops if role == Role.PLATFORM_ADMIN else alice
    client = signed_in(org, role)
    before = _counts()
    response = client.post(url, body(alice))
    assert response.status_code == 422, response.content[:500]
    assert message.encode() in response.content
    assert b'class="error"' in response.content or b'class="errors"' in response.content
    assert _counts() == before


DEPLOYMENT = {"enabled": "on", "max_batch_size": "8", "max_wait_ms": "10",
              "max_queue_depth": "256", "tenant_queue_share": "0.5", "min_replicas": "1",
              "max_replicas": "2", "scale_up_delay_s": "1", "scale_down_delay_s": "30",
              "scale_to_zero_delay_s": "300", "max_queue_age_s": "2"}


def test_edit_forms_refuse_bad_input_and_keep_the_row(ops: Org, alice: Org) -> None:
    deployment = Deployment.objects.create(name="echo", runtime="echo")
    quota = Quota.objects.create(tenant=alice.tenant, max_tokens=100)
    limit = RateLimitPolicy.objects.create(tenant=alice.tenant, scope=RateLimitScope.TENANT,
                                           requests_per_minute=10)
    client = signed_in(ops, Role.PLATFORM_ADMIN)
    cases = [
        ("/ui/deployments/echo", {**DEPLOYMENT, "min_replicas": "3", "max_replicas": "2"},
         "must not exceed max_replicas"),
        ("/ui/deployments/echo", {**DEPLOYMENT, "scale_up_delay_s": "-1"},
         "greater than or equal to"),
        ("/ui/deployments/echo", {**DEPLOYMENT, "max_batch_size": "0"},
         "greater than or equal to"),
        ("/ui/deployments/echo/breaker", {
            "window_kind": "count", "window_size": "100", "min_calls": "20",
            "failure_rate": "0.5", "slow_call_ms": "30000", "slow_call_rate": "1",
            "open_wait_s": "30", "half_open_probes": "3", "probe_timeout_s": "60",
            "memory_high": "0.5", "memory_low": "0.9", "memory_hold_s": "10",
            "degrade_mode": "shorten", "degraded_max_tokens": "64", "priority_share": "0.2"},
         "memory_low must be below memory_high."),
        (f"/ui/quotas/{quota.pk}", {"period": "day", "window": "calendar",
                                    "max_tokens": "lots"}, "Enter a whole number."),
        (f"/ui/limits/{limit.pk}", {"requests_per_minute": "10", "qps_ref": "1000",
                                    "qps_min": "0.5", "qps_max": "2", "p99_target_ms": "200",
                                    "p99_slope": "0.01", "floor": "5", "window_s": "60"},
         "less than or equal to"),
    ]
    for url, body, message in cases:
        response = client.post(url, body)
        assert response.status_code == 422, (url, response.content[:300])
        assert message.encode() in response.content, url
    deployment.refresh_from_db()
    assert (deployment.min_replicas, deployment.scale_up_delay_s) == (1, 1.0)
    assert not BreakerPolicy.objects.filter(deployment=deployment).exists()  # defaults kept
    quota.refresh_from_db()
    limit.refresh_from_db()
    assert quota.max_tokens == 100 and limit.floor == 0.3


def test_forms_need_the_csrf_token(alice: Org) -> None:
    strict = Client(enforce_csrf_checks=True)
    assert strict.post("/ui/login", {"username": "alice-developer",
                                     "password": PASSWORD}).status_code == 403
    strict.cookies = signed_in(alice, Role.DEVELOPER).cookies  # a session, no token
    response = strict.post("/ui/keys/new", {"name": "no token"})
    assert response.status_code == 403
    assert not ApiKey.objects.filter(name="no token").exists()


def test_a_new_key_shows_its_secret_once_and_it_works(alice: Org) -> None:
    client = signed_in(alice, Role.DEVELOPER)
    response = client.post("/ui/keys/new", {"name": "from the ui"})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    key = ApiKey.objects.get(name="from the ui")
    secret = response.context["secret"]
    assert secret.startswith("sk-sluice-") and secret.encode() in response.content
    assert key.key_hash not in response.content.decode()
    listing = client.get("/ui/keys").content.decode()
    assert key.prefix in listing and secret not in listing
    api = Client().get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert api.status_code == 200


def test_names_are_escaped(alice: Org) -> None:
    client = signed_in(alice, Role.DEVELOPER)
    client.post("/ui/keys/new", {"name": "<script>alert(1)</script>"})
    page = client.get("/ui/keys").content
    assert b"<script>alert(1)</script>" not in page
    assert b"&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_key_list_pages_stay_fast_with_100000_keys(alice: Org) -> None:
    member = alice.members[Role.DEVELOPER]
    ApiKey.objects.bulk_create([
        ApiKey(tenant=alice.tenant, name=f"bulk {i}", prefix=f"b{i:09d}", key_hash=f"{i:064d}",
               role=Role.DEVELOPER, created_by=member.subject, member=member)
        for i in range(100_000)], batch_size=5000)
    client = signed_in(alice, Role.DEVELOPER)
    began = time.perf_counter()
    first = client.get("/ui/keys")
    took_first = time.perf_counter() - began
    url = first.context["page"].next_url
    for _ in range(3):  # deep into the list: keyset, not OFFSET
        response = client.get(url)
        url = response.context["page"].next_url
    began = time.perf_counter()
    deep = client.get(url)
    took_deep = time.perf_counter() - began
    assert deep.status_code == 200 and len(deep.context["page"].rows) == 50
    assert took_first < 1.0 and took_deep < 1.0, (took_first, took_deep)


def test_a_tenant_admin_cannot_demote_the_last_admin(alice: Org) -> None:
    client = signed_in(alice, Role.TENANT_ADMIN)
    me = alice.members[Role.TENANT_ADMIN]
    response = client.post(f"/ui/members/{me.pk}", {"role": "developer", "is_active": "on"})
    assert response.status_code == 422
    assert b"at least one active admin" in response.content
    me.refresh_from_db()
    assert me.role == Role.TENANT_ADMIN
    developer = alice.members[Role.DEVELOPER]
    assert client.post(f"/ui/members/{developer.pk}", {"role": "auditor"}).status_code == 302
    developer.refresh_from_db()
    assert (developer.role, developer.is_active) == (Role.AUDITOR, False)
