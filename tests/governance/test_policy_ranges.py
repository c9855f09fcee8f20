"""Governance policy numbers: each has a documented range (governance.ranges, listed in
docs/GOVERNANCE.md). The API and the admin UI refuse a value outside it, naming the
field; a value outside it that is stored anyway (written straight into the database, or
before the check existed) never breaks a call: the hot path reads it clamped."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from django.conf import settings

from governance import cache as policy_cache
from governance.models import BreakerPolicy, Quota, RateLimitPolicy, RateLimitScope
from governance.ranges import BREAKER, QUOTA, RATE_LIMIT, Range
from inference.models import Deployment
from inference.queue import guard_key
from sluice.redis import sync_client
from tenants.roles import Role
from tests.conftest import Org, assert_openai_error, eventually, make_org
from tests.frontend.test_pages import signed_in
from tests.streaming.conftest import Live

PA = Role.PLATFORM_ADMIN


def _outside(bounds: Range) -> list[Any]:
    """Values just past each bound, far past them, and the non-finite (as JSON text)."""
    if bounds.integer:
        return [int(bounds.hi) + 1, int(bounds.lo) - 1, 10**20]
    return [bounds.hi * 1.5 + 1, bounds.lo - 0.5, 1e308, "NaN", "Infinity", "-Infinity"]


def _body(field: str, value: Any) -> bytes:
    # Python's json (ninja's parser) reads NaN and Infinity: a client can send them.
    return f'{{"{field}": {value if isinstance(value, str) else json.dumps(value)}}}'.encode()


@pytest.fixture
def policies(ops: Org, alice: Org) -> dict[str, Any]:
    Deployment.objects.create(name="echo", runtime="echo")
    limit = RateLimitPolicy.objects.create(scope=RateLimitScope.TENANT, tenant=alice.tenant,
                                           requests_per_minute=10)
    quota = Quota.objects.create(tenant=alice.tenant, max_tokens=100)
    return {"limit": limit, "quota": quota}


def _snapshot() -> list[Any]:
    return [list(model.objects.values()) for model in (RateLimitPolicy, Quota, BreakerPolicy)]


@pytest.mark.django_db
def test_qps_max_1e308_is_refused_naming_the_field(ops: Org, alice: Org,
                                                   policies: dict[str, Any]) -> None:
    # The probe's case: qps_max 1e308, then adaptive on, broke every chat of the tenant.
    client = ops.client(PA)
    error = assert_openai_error(client.post("/api/v1/governance/rate-limits", {
        "scope": "tenant", "tenant_id": alice.tenant.pk, "requests_per_minute": 5,
        "qps_max": 1e308}), 422)
    assert error["param"] == "qps_max" and "qps_max" in error["message"]
    url = f"/api/v1/governance/rate-limits/{policies['limit'].pk}"
    error = assert_openai_error(client.patch(url, {"qps_max": 1e308}), 422)
    assert error["param"] == "qps_max"
    assert client.patch(url, {"adaptive": True, "qps_max": 100}).status == 200
    assert RateLimitPolicy.objects.get().qps_max == 100


@pytest.mark.django_db
@pytest.mark.parametrize(("kind", "field"), [
    *(("limit", f) for f in RATE_LIMIT), *(("quota", f) for f in QUOTA),
    *(("breaker", f) for f in BREAKER)])
def test_every_policy_number_outside_its_range_is_refused_naming_it(
        ops: Org, policies: dict[str, Any], kind: str, field: str) -> None:
    # Given a saved policy of each kind
    client = ops.client(PA)
    method, url, table = {
        "limit": ("PATCH", f"/api/v1/governance/rate-limits/{policies['limit'].pk}",
                  RATE_LIMIT),
        "quota": ("PATCH", f"/api/v1/governance/quotas/{policies['quota'].pk}", QUOTA),
        "breaker": ("PUT", "/api/v1/governance/breakers/echo", BREAKER)}[kind]
    before = _snapshot()
    # When a number outside the field's range is sent, then it is a 422 naming it
    for value in _outside(table[field]):
        error = assert_openai_error(client.call(method, url, raw=_body(field, value)), 422)
        assert error["param"] == field, (field, value, error)
    # and nothing changed; the documented maximum itself is accepted (with what the
    # rules across fields need beside it).
    assert _snapshot() == before
    if field == "memory_low":
        return  # below memory_high, at most 1.0: its maximum can never be saved alone
    hi = int(table[field].hi) if table[field].integer else table[field].hi
    beside: dict[str, dict[str, Any]] = {"min_calls": {"window_kind": "time"},
                                         "qps_min": {"qps_max": 100.0}}
    response = client.call(method, url, {field: hi, **beside.get(field, {})})
    assert response.status == 200, (field, hi, response.body)


@pytest.mark.django_db
def test_the_admin_ui_refuses_a_policy_number_outside_its_range(
        ops: Org, policies: dict[str, Any]) -> None:
    limit = policies["limit"]
    response = signed_in(ops, PA).post(f"/ui/limits/{limit.pk}", {
        "requests_per_minute": "10", "qps_ref": "1000", "qps_min": "0.5", "qps_max": "1e308",
        "p99_target_ms": "200", "p99_slope": "0.01", "floor": "0.3", "window_s": "60"})
    assert response.status_code == 422
    assert b"qps_max: must be a number from 0.0 to 100.0" in response.content
    limit.refresh_from_db()
    assert limit.qps_max == 2.0


# -- stored out of range: the hot path ---------------------------------------------------
NAN, INF = math.nan, math.inf
# Rows as the API could never have saved them, written straight into the database.
STORED: list[tuple[str, dict[str, Any]]] = [
    ("limit", {"adaptive": True, "qps_max": 1e308}),
    ("limit", {"adaptive": True, "qps_max": 1e308, "qps_min": 1e308}),
    ("limit", {"adaptive": True, "qps_max": INF, "qps_min": INF}),
    ("limit", {"adaptive": True, "qps_ref": 0.0}),
    ("limit", {"adaptive": True, "qps_min": NAN, "qps_max": NAN, "qps_ref": NAN}),
    ("limit", {"adaptive": True, "p99_slope": 1e308, "floor": -INF, "p99_target_ms": NAN}),
    ("limit", {"adaptive": True, "window_s": 0}),
    ("limit", {"requests_per_minute": 0, "burst_requests": 0, "tokens_per_minute": 2**31 - 1,
               "burst_tokens": 0}),
    ("quota", {"max_tokens": 2**63 - 1, "max_requests": 2**63 - 1, "max_concurrent": 0}),
    ("quota", {"period": "year", "window": "sideways"}),
    ("breaker", {"open_wait_s": INF, "probe_timeout_s": -1.0, "memory_hold_s": NAN,
                 "priority_share": NAN, "failure_rate": -1.0, "slow_call_rate": NAN}),
    ("breaker", {"window_kind": "weird", "window_size": 0, "min_calls": 0,
                 "slow_call_ms": 0, "half_open_probes": 0, "degrade_mode": "?",
                 "degraded_max_tokens": 0, "memory_high": INF, "memory_low": -INF}),
]


@pytest.fixture
def tenant(live: Live) -> Iterator[Org]:
    org = make_org("alice", [Role.DEVELOPER])
    yield org
    policy_cache.clear()


def _chat(live: Live, key: str) -> httpx.Response:
    return httpx.post(f"{live.base_url}/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "stored"), STORED,
                         ids=[f"{k}:{','.join(s)}" for k, s in STORED])
def test_a_stored_policy_out_of_range_never_breaks_a_chat_call(
        live: Live, tenant: Org, kind: str, stored: dict[str, Any]) -> None:
    # Given a policy of the tenant (or the deployment) that was saved in range
    echo = Deployment.objects.get(name="echo")
    rows = {"limit": RateLimitPolicy.objects.create(
                scope=RateLimitScope.TENANT, tenant=tenant.tenant, requests_per_minute=600,
                tokens_per_minute=100_000),
            "quota": Quota.objects.create(tenant=tenant.tenant, max_tokens=100_000),
            "breaker": BreakerPolicy.objects.create(deployment=echo)}
    key = tenant.keys[Role.DEVELOPER]
    assert _chat(live, key).status_code == 200
    # When its numbers are overwritten in the database with ones out of range
    type(rows[kind])._default_manager.filter(pk=rows[kind].pk).update(**stored)
    policy_cache.clear()
    # then the tenant's calls are still served, with finite rate-limit headers (a
    # max_concurrent of 0 reads as 1: the first call's slot is released just after its
    # reply was written, so the next may arrive a moment before it is free).
    def served() -> Any:
        answer = _chat(live, key)
        return answer if answer.status_code == 200 else None

    response = eventually(served, 10) or _chat(live, key)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "hi"
    for name, value in response.headers.items():
        if name.startswith("x-ratelimit-limit-"):
            assert re.fullmatch(r"[0-9]+", value), (name, value)


@pytest.mark.slow
def test_garbage_in_redis_state_never_breaks_a_chat_call(live: Live, tenant: Org) -> None:
    # Given a tenant rate limit whose bucket exists, and the memory guard's thresholds
    RateLimitPolicy.objects.create(scope=RateLimitScope.TENANT, tenant=tenant.tenant,
                                   requests_per_minute=600)
    key = tenant.keys[Role.DEVELOPER]
    assert _chat(live, key).status_code == 200
    rds = sync_client(settings.REDIS_URL)
    buckets = list(rds.scan_iter(f"sluice:{{{tenant.tenant.slug}}}:rl:*"))  # every master
    assert buckets
    # When both are overwritten with values that are no numbers
    for bucket in buckets:
        rds.hset(bucket, mapping={"v": "garbage", "t": "nan"})
    rds.hset(guard_key("echo"), mapping={"high": "nan", "low": "-inf", "hold_s": "x"})
    # then calls are served (the limit fails open, as its policy says, and says so).
    response = _chat(live, key)
    assert response.status_code == 200, response.text
    assert response.headers["x-ratelimit-status"] == "unavailable"
