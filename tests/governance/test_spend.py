"""Spend history: real calls through a live gateway, audited, rolled into hourly and
daily rows (governance/rollups.py) and read through /api/v1/governance/spend, whose
sums are exact and whose rows each role sees as it may."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import openai
import pytest

from governance import audit, rollups
from governance import cache as policy_cache
from governance.models import Price, UsageDay, UsageHour
from tenants.models import Tenant
from tenants.roles import Role
from tests.conftest import Org, assert_openai_error, make_org
from tests.streaming.conftest import Live

PA, TA, DEV, AUD = Role.PLATFORM_ADMIN, Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR
URL = "/api/v1/governance/spend"


def _range(hours: int = 2) -> dict[str, str]:
    now = datetime.now(UTC)
    return {"from": (now - timedelta(hours=hours)).isoformat(),
            "to": (now + timedelta(hours=1)).isoformat()}


def _query(params: dict[str, Any]) -> str:
    from urllib.parse import urlencode
    return f"{URL}?{urlencode(params)}"


@pytest.mark.slow
def test_calls_roll_into_exact_spend_rows_each_role_sees_its_part(live: Live) -> None:
    Price.objects.create(model="echo", input_per_mtok_usd=1000, output_per_mtok_usd=1000,
                         valid_from=datetime.now(UTC) - timedelta(days=1))
    org = make_org("spender", [TA, DEV, AUD])
    other = make_org("bystander", [TA])
    policy_cache.clear()
    costs: dict[str, Decimal] = {}
    for role, texts in ((DEV, ["one", "two", "three"]), (TA, ["four"])):
        client = openai.OpenAI(base_url=live.base_url, api_key=org.keys[role], max_retries=0,
                               timeout=30)
        for text in texts:
            raw = client.chat.completions.with_raw_response.create(
                model="echo", messages=[{"role": "user", "content": text}])
            costs[org.key_rows[role].prefix] = costs.get(org.key_rows[role].prefix,
                                                         Decimal(0)) + Decimal(
                raw.headers["x-sluice-cost-usd"])
    with pytest.raises(openai.NotFoundError):  # an error is a call too
        openai.OpenAI(base_url=live.base_url, api_key=org.keys[DEV], max_retries=0
                      ).chat.completions.create(model="nope", messages=[
                          {"role": "user", "content": "x"}])
    audit.drain()
    written = rollups.roll()
    assert written > 0 and rollups.roll() == written, "a rerun writes the same rows"
    assert UsageHour.objects.filter(tenant=org.tenant).exists()
    by_key = org.client(TA).get(_query({**_range(), "group_by": "key",
                                        "granularity": "hour", "latency": "true"}))
    assert by_key.status == 200, by_key.body
    spent: dict[str, Decimal] = {}
    calls: dict[str, tuple[int, int]] = {}
    for r in by_key.body:  # an hour each; the calls may straddle two
        spent[r["key_prefix"]] = spent.get(r["key_prefix"], Decimal(0)) + Decimal(r["cost_usd"])
        was = calls.get(r["key_prefix"], (0, 0))
        calls[r["key_prefix"]] = (was[0] + r["calls"], was[1] + r["errors"])
        assert r["latency_p50_ms"] is not None and r["latency_p95_ms"] >= r["latency_p50_ms"]
    assert spent == costs
    assert calls[org.key_rows[DEV].prefix] == (4, 1)  # three answered, one 404
    days = org.client(AUD).get(_query({**_range(48), "granularity": "day"})).body
    assert sum(Decimal(d["cost_usd"]) for d in days) == sum(costs.values())
    assert sum(d["calls"] for d in days) == 5
    mine = org.client(DEV).get(_query({**_range(), "group_by": "key"})).body
    assert {r["key_prefix"] for r in mine} == {org.key_rows[DEV].prefix}
    by_member = org.client(TA).get(_query({**_range(), "group_by": "member"})).body
    assert {r["member_id"] for r in by_member} == {org.members[DEV].pk, org.members[TA].pk}
    # Another tenant's spend is a missing tenant; nothing of theirs shows in ours.
    assert_openai_error(other.client(TA).get(_query({**_range(),
                                                     "tenant_id": org.tenant.pk})), 404)
    assert other.client(TA).get(_query(_range())).body == []


@pytest.mark.django_db
@pytest.mark.parametrize(("params", "param"), [
    ({"from": "2026-01-02T00:00:00Z", "to": "2026-01-01T00:00:00Z"}, "to"),
    ({"from": "2025-01-01T00:00:00Z", "to": "2026-06-01T00:00:00Z"}, "from"),
    ({"from": "2026-01-01T00:00:00Z", "to": "2026-03-01T00:00:00Z", "granularity": "hour"},
     "from"),
    ({"from": "yesterday", "to": "2026-01-01T00:00:00Z"}, None),
    ({"from": "2026-01-01T00:00:00Z", "to": "2026-01-02T00:00:00Z", "group_by": "team"},
     None),
])
def test_bad_spend_ranges_are_4xx(alice: Org, params: dict[str, str], param: str | None) -> None:
    error = assert_openai_error(alice.client(TA).get(_query(params)), 422)
    if param:
        assert error["param"] == param


@pytest.mark.django_db(transaction=True)
def test_days_follow_the_tenants_time_zone() -> None:
    """Two calls an hour apart across Tokyo's midnight (15:00 UTC) land on two days."""
    tenant = Tenant.objects.create(slug="tokyo", name="Tokyo", time_zone="Asia/Tokyo")
    base = datetime(2026, 3, 10, 14, 30, tzinfo=UTC)
    audit.write_events([_call(tenant, base, "0.000001"), _call(tenant, base + timedelta(hours=1),
                                                                "0.000002")])
    rollups.roll(now=base + timedelta(hours=1), hours=2)
    days = list(UsageDay.objects.filter(tenant=tenant).order_by("start"))
    assert [(d.start, d.cost_nanousd) for d in days] == [
        (datetime(2026, 3, 9, 15, tzinfo=UTC), 1000), (datetime(2026, 3, 10, 15, tzinfo=UTC),
                                                        2000)]


def _call(tenant: Tenant, at: datetime, cost: str) -> dict[str, Any]:
    return {"chain": tenant.slug, "at": at, "tenant_id": tenant.pk, "actor": "member:1",
            "role": "developer", "key_prefix": "k1", "action": "chat.completions",
            "target": "", "model": "echo", "protocol": "rest", "status": 200,
            "latency_ms": 12.0, "prompt_tokens": 3, "completion_tokens": 4, "request_id": "",
            "trace_id": "", "request_excerpt": "", "response_excerpt": "",
            "detail": {"cost_usd": cost}, "source": f"t-{at.timestamp()}"}
