"""The governance management API: validation, scoping, the live figures it shows, and
that an edit reaches the gateway's cache."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings

from governance import cache as policy_cache
from governance.models import BreakerPolicy, RateLimitPolicy
from inference.models import Deployment
from inference.queue import guard_key
from sluice.redis import sync_client
from tenants.roles import Role
from tests.conftest import Org, assert_openai_error

pytestmark = [pytest.mark.django_db, pytest.mark.cluster]

PA, TA = Role.PLATFORM_ADMIN, Role.TENANT_ADMIN


@pytest.fixture
def echo(db: None) -> str:
    Deployment.objects.get_or_create(name="echo-api", defaults={"runtime": "echo"})
    return "echo-api"


@pytest.mark.parametrize(("body", "param"), [
    ({"scope": "tenant"}, None),  # neither requests nor tokens per minute
    ({"scope": "tenant", "requests_per_minute": -5}, "requests_per_minute"),
    ({"scope": "tenant", "requests_per_minute": 5, "window_s": 0}, "window_s"),
    ({"scope": "tenant", "requests_per_minute": 5, "qps_min": 3, "qps_max": 1}, None),
    ({"scope": "tenant", "requests_per_minute": 5, "floor": 1.5}, "floor"),
    ({"scope": "tenant", "requests_per_minute": 5, "model": "x"}, None),
    ({"scope": "galaxy", "requests_per_minute": 5}, "scope"),
    ({"scope": "tenant", "requests_per_minute": 5, "surprise": 1}, "surprise"),
])
def test_rate_limit_validation(ops: Org, body: dict[str, object], param: str | None) -> None:
    response = ops.client(PA).post("/api/v1/governance/rate-limits", body)
    error = assert_openai_error(response, 422)
    if param is not None:
        assert error["param"] == param
    assert RateLimitPolicy.objects.count() == 0


@pytest.mark.parametrize("field", ["name", "model", "adaptive", "qps_ref", "fail_open"])
def test_an_explicit_null_for_a_field_with_a_default_is_422(ops: Org, alice: Org,
                                                           field: str) -> None:
    # Found by Schemathesis: `"name": null` reached the database as NULL (a 500).
    body = {"scope": "tenant", "tenant_id": alice.tenant.pk, "requests_per_minute": 5}
    error = assert_openai_error(ops.client(PA).post("/api/v1/governance/rate-limits",
                                                    {**body, field: None}), 422)
    assert (error["param"], error["code"]) == (field, "null_value")
    made = ops.client(PA).post("/api/v1/governance/rate-limits", body)
    assert made.status == 201, made.body
    error = assert_openai_error(ops.client(PA).call(
        "PATCH", f"/api/v1/governance/rate-limits/{made.body['id']}", {field: None}), 422)
    assert error["param"] == field
    assert RateLimitPolicy.objects.count() == 1


def test_explicit_nulls_in_quotas_and_breakers_are_422(ops: Org, alice: Org,
                                                       echo: str) -> None:
    error = assert_openai_error(ops.client(PA).post("/api/v1/governance/quotas", {
        "tenant_id": alice.tenant.pk, "max_tokens": 10, "shadow": None}), 422)
    assert error["param"] == "shadow"
    error = assert_openai_error(ops.client(PA).call(
        "PUT", f"/api/v1/governance/breakers/{echo}", {"degrade_mode": None}), 422)
    assert error["param"] == "degrade_mode"


@pytest.mark.parametrize(("body", "param"), [
    ({"memory_high": 0.8, "memory_low": 0.9}, None),
    ({"memory_high": 1.5}, "memory_high"),
    ({"window_size": 0}, "window_size"),
    ({"open_wait_s": -1}, "open_wait_s"),
    ({"window_kind": "count", "window_size": 5, "min_calls": 10}, None),
    ({"failure_rate": 2}, "failure_rate"),
])
def test_breaker_validation(ops: Org, echo: str, body: dict[str, object],
                            param: str | None) -> None:
    response = ops.client(PA).call("PUT", f"/api/v1/governance/breakers/{echo}", body)
    error = assert_openai_error(response, 422)
    if param is not None:
        assert error["param"] == param
    assert not BreakerPolicy.objects.exists()


def test_breaker_update_reaches_the_workers_and_shows_live_state(
        ops: Org, echo: str, django_capture_on_commit_callbacks: Any) -> None:
    client = ops.client(PA)
    got = client.get(f"/api/v1/governance/breakers/{echo}")
    assert got.status == 200 and got.body["failure_rate"] == 0.5  # the defaults
    assert got.body["live"]["state"] == "closed" and got.body["live"]["workers"] == 0
    with django_capture_on_commit_callbacks(execute=True):
        put = client.call("PUT", f"/api/v1/governance/breakers/{echo}",
                          {"memory_high": 0.95, "memory_low": 0.9, "shed_queue_depth": 50})
    assert put.status == 200 and put.body["shed_queue_depth"] == 50
    guard = sync_client(settings.REDIS_URL).hgetall(guard_key(echo))
    assert guard == {b"high": b"0.95", b"low": b"0.9", b"hold_s": b"10.0"}
    cleared = client.call("PUT", f"/api/v1/governance/breakers/{echo}",
                          {"shed_queue_depth": None})
    assert cleared.body["shed_queue_depth"] is None and cleared.body["memory_high"] == 0.95
    missing = client.get("/api/v1/governance/breakers/nope")
    assert_openai_error(missing, 404)


def test_tenant_admin_limits_own_keys_only(alice: Org, bob: Org) -> None:
    client = alice.client(TA)
    made = client.post("/api/v1/governance/rate-limits",
                       {"scope": "api_key", "requests_per_minute": 30,
                        "api_key_id": alice.key_rows[Role.DEVELOPER].pk})
    assert made.status == 201 and made.body["tenant_id"] == alice.tenant.pk
    for body in ({"scope": "tenant", "requests_per_minute": 30},
                 {"scope": "model", "requests_per_minute": 30}):
        assert_openai_error(client.post("/api/v1/governance/rate-limits", body), 403)
    someone_elses = client.post("/api/v1/governance/rate-limits",
                                {"scope": "api_key", "requests_per_minute": 30,
                                 "api_key_id": bob.key_rows[Role.DEVELOPER].pk})
    assert_openai_error(someone_elses, 404)
    other_tenant = client.post("/api/v1/governance/rate-limits",
                               {"scope": "api_key", "requests_per_minute": 30,
                                "tenant_id": bob.tenant.pk})
    assert_openai_error(other_tenant, 404)  # like a missing tenant: no oracle


def test_defaults_apply_and_specific_policies_win(ops: Org, alice: Org) -> None:
    admin = ops.client(PA)
    default = admin.post("/api/v1/governance/rate-limits",
                         {"scope": "tenant", "requests_per_minute": 600})
    assert default.status == 201 and default.body["tenant_id"] is None
    own = admin.post("/api/v1/governance/rate-limits",
                     {"scope": "tenant", "requests_per_minute": 60,
                      "tenant_id": alice.tenant.pk})
    per_model = admin.post("/api/v1/governance/rate-limits",
                           {"scope": "model", "requests_per_minute": 6, "model": "m1"})
    each_model = admin.post("/api/v1/governance/rate-limits",
                            {"scope": "model", "tokens_per_minute": 1000})
    policies = policy_cache.load_tenant(alice.tenant.pk)
    chosen = policies.limits_for(key_id=7, model="m1")
    assert [(p.pk, s) for p, s in chosen] == [(own.body["id"], "t"),
                                              (per_model.body["id"], "m:m1")]
    chosen = policies.limits_for(key_id=7, model="m2")
    assert [(p.pk, s) for p, s in chosen] == [(own.body["id"], "t"),
                                              (each_model.body["id"], "m:m2")]
    # alice's admin sees her own limit and the platform defaults, not other tenants'
    seen = {r["id"] for r in alice.client(TA).get("/api/v1/governance/rate-limits").body[
        "items"]}
    assert seen == {default.body["id"], own.body["id"], per_model.body["id"],
                    each_model.body["id"]}


def test_rate_limit_detail_shows_the_effective_rate(ops: Org, echo: str) -> None:
    made = ops.client(PA).post("/api/v1/governance/rate-limits",
                               {"scope": "model", "model": echo, "requests_per_minute": 100,
                                "adaptive": True, "qps_ref": 10, "qps_min": 0.2})
    detail = ops.client(PA).get(f"/api/v1/governance/rate-limits/{made.body['id']}")
    assert detail.status == 200
    assert detail.body["effective"] == [{
        "model": echo, "factor": 0.2, "qps": 0.0, "p99_ms": None, "samples": 0,
        "requests_per_minute": 20.0, "tokens_per_minute": None}]


def test_quota_detail_shows_live_use(ops: Org, alice: Org) -> None:
    made = ops.client(PA).post("/api/v1/governance/quotas",
                               {"tenant_id": alice.tenant.pk, "model": "echo",
                                "period": "month", "max_tokens": 1000})
    assert made.status == 201
    detail = alice.client(TA).get(f"/api/v1/governance/quotas/{made.body['id']}")
    assert detail.status == 200
    assert detail.body["usage"]["tokens"] == 0 and detail.body["usage"]["resets_at"]
    bad = ops.client(PA).post("/api/v1/governance/quotas", {"tenant_id": alice.tenant.pk})
    assert_openai_error(bad, 422)
    assert_openai_error(ops.client(PA).post("/api/v1/governance/quotas",
                                            {"tenant_id": 999_999, "max_tokens": 5}), 404)
