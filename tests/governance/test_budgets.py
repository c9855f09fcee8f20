"""Budgets in money: who sets which, the reservation that keeps concurrent calls from
overshooting, the calendar windows that roll over with no reset job, a dead gateway's
hold expiring uncharged, and the refusal in each API's own shape."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from decimal import Decimal
from subprocess import Popen
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest
import redis

from governance import cache as policy_cache
from governance import live as live_state
from governance import pricing
from governance.models import Budget, BudgetScope, Price
from governance.quota import (
    PEEK_LUA,
    RESERVE_LUA,
    SETTLE_LUA,
    Settlement,
    keys_for,
    peek_args,
    reserve_args,
    settle_call,
)
from streaming.protos import inference_pb2 as pb
from streaming.protos import inference_pb2_grpc as pb_grpc
from tenants.models import Tenant
from tenants.roles import Role
from tests.conftest import (
    Org,
    assert_openai_error,
    eventually,
    gateway_process,
    process_env,
)
from tests.streaming.conftest import Live

PA, TA, DEV, AUD = Role.PLATFORM_ADMIN, Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR
URL = "/api/v1/governance/budgets"


# -- the API ---------------------------------------------------------------------------
@pytest.mark.django_db
def test_platform_admins_set_tenant_budgets_tenant_admins_their_members_and_keys(
        ops: Org, alice: Org) -> None:
    tenant = ops.client(PA).post(URL, {"tenant_id": alice.tenant.pk, "limit_usd": "10",
                                       "window": "month"})
    assert tenant.status == 201, tenant.body
    assert (tenant.body["scope"], tenant.body["limit_usd"]) == ("tenant", "10")
    assert_openai_error(alice.client(TA).post(URL, {"limit_usd": 1}), 403)
    member = alice.members[DEV].pk
    made = alice.client(TA).post(URL, {"scope": "member", "member_id": member,
                                       "limit_usd": "2.5", "window": "month"})
    assert made.status == 201 and made.body["member_id"] == member, made.body
    key = alice.key_rows[DEV].pk
    keyed = alice.client(TA).post(URL, {"scope": "key", "key_id": key, "limit_usd": "1",
                                        "window": "day", "model": "echo"})
    assert keyed.status == 201 and keyed.body["key_id"] == key, keyed.body
    # Never above the tenant's budget of the same window.
    error = assert_openai_error(alice.client(TA).post(URL, {
        "scope": "member", "member_id": member, "limit_usd": "10.01"}), 422)
    assert error["param"] == "limit_usd"
    detail = alice.client(TA).get(f"{URL}/{made.body['id']}")
    assert detail.status == 200 and detail.body["usage"]["spent_usd"] == "0.000000000"
    assert detail.body["usage"]["resets_at"] is not None
    assert_openai_error(alice.client(TA).call("PATCH", f"{URL}/{tenant.body['id']}",
                                              {"limit_usd": 100}), 403)
    assert alice.client(TA).call("PATCH", f"{URL}/{made.body['id']}",
                                 {"limit_usd": "3"}).body["limit_usd"] == "3"
    assert_openai_error(alice.client(DEV).get(URL), 403)
    assert alice.client(AUD).get(URL).body["count"] == 3, "auditors read budgets"
    assert_openai_error(alice.client(AUD).call("PATCH", f"{URL}/{made.body['id']}",
                                               {"limit_usd": "1"}), 403)
    assert Budget.objects.count() == 3


@pytest.mark.django_db
@pytest.mark.parametrize(("change", "param"), [
    ({"limit_usd": -1}, "limit_usd"),
    ({"limit_usd": "1000000.01"}, "limit_usd"),
    ({"limit_usd": "0.0000001"}, "limit_usd"),
    ({"limit_usd": "NaN"}, "limit_usd"),
    ({"scope": "galaxy"}, "scope"),
    ({"window": "year"}, "window"),
    ({"scope": "member"}, "member_id"),  # a member budget without its member
    ({"scope": "key"}, "key_id"),
    ({"model": "a b"}, "model"),
    ({"alert": 5}, "alert"),
])
def test_bad_budgets_are_422_and_save_nothing(ops: Org, alice: Org, change: dict[str, Any],
                                              param: str) -> None:
    body = {"tenant_id": alice.tenant.pk, "limit_usd": 5, **change}
    error = assert_openai_error(ops.client(PA).post(URL, body), 422)
    assert error["param"] == param, error
    assert Budget.objects.count() == 0


@pytest.mark.django_db
def test_another_tenants_member_or_key_is_the_same_as_a_missing_one(alice: Org,
                                                                   bob: Org) -> None:
    for field, theirs in (("member_id", bob.members[DEV].pk), ("key_id", bob.key_rows[DEV].pk)):
        scope = field.removesuffix("_id")
        other = alice.client(TA).post(URL, {"scope": scope, field: theirs, "limit_usd": 1})
        missing = alice.client(TA).post(URL, {"scope": scope, field: 10**9, "limit_usd": 1})
        assert (other.status, other.body) == (missing.status, missing.body) \
            and other.status == 404
    mine = alice.client(TA).post(URL, {"scope": "member", "member_id": alice.members[DEV].pk,
                                       "limit_usd": 1})
    for client in (bob.client(TA),):
        assert_openai_error(client.get(f"{URL}/{mine.body['id']}"), 404)
        assert_openai_error(client.call("DELETE", f"{URL}/{mine.body['id']}"), 404)
    assert Budget.objects.count() == 1


@pytest.mark.django_db
def test_the_demo_seed_prices_its_models_and_gives_the_tenant_a_budget() -> None:
    from governance.services import DEMO_BUDGET_USD, DEMO_PRICES, demo_money_seed
    from tenants.services import demo_seed
    tenant = demo_seed().tenant
    first = demo_money_seed(tenant_slug=tenant)
    again = demo_money_seed(tenant_slug=tenant)  # every start: nothing doubles
    assert first.pk == again.pk and Budget.objects.count() == 1
    assert (first.scope, first.window, first.limit_usd) == ("tenant", "month", DEMO_BUDGET_USD)
    assert {p.model for p in Price.objects.all()} == set(DEMO_PRICES)
    assert Price.objects.count() == len(DEMO_PRICES)


# -- the scripts: windows, holds -------------------------------------------------------
def b(pk: int, window: str, limit: str = "1", zone: str = "UTC",
      alert_at: tuple[int, ...] = ()) -> Budget:
    row = Budget(scope=BudgetScope.TENANT, window=window, limit_usd=Decimal(limit),
                 tenant=Tenant(slug="t", time_zone=zone), alert_at=list(alert_at))
    row.pk = pk
    return row


def ts(*parts: int) -> float:
    return datetime(*parts, tzinfo=UTC).timestamp()


def reserve(rds: redis.Redis, budgets: list[Budget], rid: str, cost: int, clock: float,
            hold: float = 60.0) -> list[Any]:
    keys = keys_for("t", budgets)
    return rds.eval(RESERVE_LUA, len(keys), *keys,
                    *reserve_args(rid, hold, budgets, 10**9, clock=clock, cost=cost))


def settle(rds: redis.Redis, budgets: list[Budget], rid: str, cost: int,
           clock: float) -> None:
    keys, args = settle_call("t", budgets, [Settlement(rid, rid, 1, 10, 20, "m|k|", cost)],
                             clock=clock)
    rds.eval(SETTLE_LUA, len(keys), *keys, *args)


def spent(rds: redis.Redis, budgets: list[Budget], clock: float) -> list[tuple[int, int]]:
    keys = keys_for("t", budgets)
    return [(int(r[1]), int(r[3]))  # (spent, held)
            for r in rds.eval(PEEK_LUA, len(keys), *keys, *peek_args(budgets, clock))]


def test_calendar_windows_roll_over_with_no_reset_job(rds: redis.Redis) -> None:
    day, week, month, total = (b(1, "day"), b(2, "week"), b(3, "month"), b(4, "total"))
    budgets = [day, week, month, total]
    sunday_night = ts(2026, 5, 31, 23, 59, 59)  # the last second of a month and a week
    assert reserve(rds, budgets, "a", 600_000_000, sunday_night)[0] == 1
    settle(rds, budgets, "a", 600_000_000, sunday_night)
    refused = reserve(rds, budgets, "b", 600_000_000, sunday_night)
    assert refused[0] == 0 and refused[1] == 0  # the day's budget refuses first
    monday = ts(2026, 6, 1, 0, 0, 1)
    reply = reserve(rds, [day, week, month], "b", 600_000_000, monday)
    assert reply[0] == 1, "a new day, week and month: nothing was reset, the slot moved"
    settle(rds, [day, week, month], "b", 600_000_000, monday)
    assert reserve(rds, [total], "c", 600_000_000, monday)[0] == 0, "a total never resets"
    assert spent(rds, budgets, monday) == [(600_000_000, 0)] * 3 + [(600_000_000, 0)]
    # The reset times the refusal names: the next midnight, Monday, the 1st; none.
    keys = keys_for("t", budgets)
    rows = rds.eval(PEEK_LUA, len(keys), *keys, *peek_args(budgets, monday))
    assert [int(r[4]) for r in rows] == [ts(2026, 6, 2), ts(2026, 6, 8), ts(2026, 7, 1), 0]


def test_a_tenants_day_begins_at_its_own_midnight(rds: redis.Redis) -> None:
    """Tokyo (UTC+9): the day rolls over at 15:00 UTC, not at UTC midnight; the refusal
    names Tokyo's next midnight."""
    day = [b(1, "day", zone="Asia/Tokyo")]
    before = ts(2026, 3, 10, 14, 59, 59)  # 23:59:59 in Tokyo
    assert reserve(rds, day, "a", 900_000_000, before)[0] == 1
    settle(rds, day, "a", 900_000_000, before)
    refused = reserve(rds, day, "b", 200_000_000, before)
    assert refused[0] == 0 and int(refused[5]) == ts(2026, 3, 10, 15)
    assert reserve(rds, day, "b", 200_000_000, ts(2026, 3, 10, 15, 0, 1))[0] == 1
    # A UTC budget on the same spend would still be in its day at 15:00 UTC.
    utc = [b(2, "day")]
    reserve(rds, utc, "c", 900_000_000, before)
    settle(rds, utc, "c", 900_000_000, before)
    assert reserve(rds, utc, "d", 200_000_000, ts(2026, 3, 10, 15, 0, 1))[0] == 0


def test_each_alert_threshold_fires_once_per_window(rds: redis.Redis) -> None:
    """Whoever settles (two settles stand for two gateways), a threshold is returned
    once in a window; one call crossing two thresholds fires both; a new window fires
    them again."""
    budget = [b(1, "day", "1", alert_at=(50, 80, 100))]
    now = ts(2026, 3, 10, 12)

    def charge(rid: str, cost: int, clock: float) -> list[str]:
        keys, args = settle_call("t", budget, [Settlement(rid, rid, 1, 10, 20, "m|k|", cost)],
                                 clock=clock)
        return [x.decode() for x in rds.eval(SETTLE_LUA, len(keys), *keys, *args)]

    assert charge("a", 400_000_000, now) == []
    assert charge("b", 100_000_000, now) == [f"0:50:500000000:{int(ts(2026, 3, 11))}"]
    assert charge("c", 10_000_000, now) == [], "50% fired already this window"
    assert [x.split(":")[1] for x in charge("d", 490_000_000, now)] == ["80", "100"]
    assert charge("e", 1, now) == []
    assert spent(rds, budget, now) == [(1_000_000_001, 0)]
    keys = keys_for("t", budget)
    assert int(rds.eval(PEEK_LUA, len(keys), *keys, *peek_args(budget, now))[0][5]) == 100
    tomorrow = ts(2026, 3, 11, 0, 0, 1)
    assert [x.split(":")[1] for x in charge("f", 600_000_000, tomorrow)] == ["50"]


def test_a_dead_gateways_hold_expires_uncharged(rds: redis.Redis) -> None:
    budget = [b(1, "month", "1")]
    now = ts(2026, 3, 10, 12)
    assert reserve(rds, budget, "dead", 900_000_000, now, hold=30)[0] == 1
    assert reserve(rds, budget, "next", 200_000_000, now + 29)[0] == 0  # still held
    assert spent(rds, budget, now + 29) == [(0, 900_000_000)]
    assert reserve(rds, budget, "next", 200_000_000, now + 31)[0] == 1
    assert spent(rds, budget, now + 31) == [(0, 200_000_000)], "expired, not charged"


def test_a_call_is_charged_once_whoever_settles_it(rds: redis.Redis) -> None:
    budget = [b(1, "day", "1")]
    now = ts(2026, 3, 10, 12)
    reserve(rds, budget, "r", 100, now)
    for _ in range(3):
        settle(rds, budget, "r", 70, now)
    assert spent(rds, budget, now) == [(70, 0)]


# -- through the gateway -----------------------------------------------------------------
def body(text: str, max_tokens: int = 16) -> dict[str, Any]:
    return {"model": "echo", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens}


async def _fire_and_kill(urls: list[str], key: str, n: int, victim: Popen[bytes] | None
                         ) -> list[httpx.Response | None]:
    """n calls spread over the gateways, 50 at a time; with a `victim`, that gateway is
    SIGKILLed once a fifth of the replies are in (its unanswered calls: None)."""
    gate, done = asyncio.Semaphore(50), 0
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as http:
        async def one(i: int) -> httpx.Response | None:
            nonlocal done
            async with gate:
                try:
                    return await http.post(f"{urls[i % len(urls)]}/chat/completions",
                                           json=body("0123456789"),
                                           headers={"Authorization": f"Bearer {key}"})
                except httpx.HTTPError:
                    assert victim is not None and i % 2 == 1, "the living gateway failed"
                    return None
                finally:
                    done += 1
                    if victim is not None and done == n // 5:
                        victim.kill()
        return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize("kill", [False, True], ids=["both-live", "one-killed"])
def test_500_calls_through_two_gateways_never_overshoot_a_budget(live: Live, payer: Org,
                                                                 kill: bool) -> None:
    """A budget that affords about 100 calls, 500 calls at once through two gateway
    processes: the spend settled is at most the limit, every refusal is a 429
    budget_exceeded, and each call is charged once (the spend is the sum of the costs the
    replies name). With the second gateway SIGKILLed mid-run, its open reservations
    expire uncharged and the spend still stays under the limit."""
    key = payer.keys[Role.DEVELOPER]
    client = openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=30)
    probe = client.chat.completions.with_raw_response.create(**body("0123456789"))
    limit = Decimal(probe.headers[pricing.COST_HEADER]) * 100
    budget = Budget.objects.create(tenant=payer.tenant, scope=BudgetScope.TENANT,
                                   window="total", limit_usd=limit)
    policy_cache.clear()
    with gateway_process(process_env()) as (proc, second):
        replies = asyncio.run(_fire_and_kill([live.base_url, f"{second}/v1"], key, 500,
                                             proc if kill else None))
    answered = [r for r in replies if r is not None]
    ok = [r for r in answered if r.status_code == 200]
    refused = [r for r in answered if r.status_code != 200]
    assert len(ok) >= 40 and len(refused) >= 100, (len(ok), len(refused))
    for r in refused:
        assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded", r.text
    costs = sum(Decimal(r.headers[pricing.COST_HEADER]) for r in ok)
    print(f"500 calls, kill={kill}: {len(ok)} answered 200 costing ${costs} of ${limit}, "
          f"{len(refused)} refused, {replies.count(None)} cut")
    if not kill:
        assert costs <= limit
        eventually(lambda: live_state.budget_use(budget)["held_usd"] == "0.000000000", 10,
                   what="every call settled")
        assert Decimal(live_state.budget_use(budget)["spent_usd"]) == costs
        return
    assert replies.count(None) > 0, "the kill cut no call"
    survivors = sum(Decimal(r.headers[pricing.COST_HEADER]) for r in replies[0::2]
                    if r is not None and r.status_code == 200)
    eventually(lambda: Decimal(live_state.budget_use(budget)["spent_usd"]) >= survivors, 10,
               what="the living gateway's settlements")
    # The killed gateway's holds outlive it by its deadline: an hour on (a `total`
    # window, so no window rolls) they are gone, and what stands charged is what was
    # settled: no more than the limit, at least what the living gateway answered.
    use = live_state.quota_use(budget, clock=time.time() + 3600)
    assert use.reserved_tokens == 0 and use.open_reservations == 0
    assert survivors <= Decimal(pricing.usd(use.tokens)) <= limit


@pytest.mark.slow
@pytest.mark.cluster
def test_each_api_refuses_over_budget_in_its_own_shape(live: Live, payer: Org,
                                                       grpc_target: str) -> None:
    Budget.objects.create(tenant=payer.tenant, scope=BudgetScope.KEY, window="total",
                          api_key=payer.key_rows[Role.DEVELOPER], limit_usd=Decimal("0"))
    policy_cache.clear()
    key = payer.keys[Role.DEVELOPER]
    client = openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=30)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(**body("over"))
    assert caught.value.code == "budget_exceeded"
    assert "does not reset" in caught.value.message
    assert caught.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(openai.RateLimitError) as caught:
        client.responses.create(model="echo", input="over")
    assert caught.value.code == "budget_exceeded"
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model="echo", prompt="over", max_tokens=4)
    assert caught.value.code == "budget_exceeded"
    with pytest.raises(openai.RateLimitError) as caught:  # a stream is refused before it starts
        client.chat.completions.create(stream=True, **body("over"))
    assert caught.value.code == "budget_exceeded"
    frames = asyncio.run(_over_the_socket(key))
    assert frames[0]["type"] == "error" and frames[0]["id"] == "b1"
    assert frames[0]["error"]["code"] == "budget_exceeded", frames
    an = anthropic.Anthropic(base_url=live.base_url.removesuffix("/v1"), api_key=key,
                             max_retries=0, timeout=30)
    with pytest.raises(anthropic.RateLimitError) as refused:
        an.messages.create(model="echo", max_tokens=8,
                           messages=[{"role": "user", "content": "over"}])
    assert refused.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert "Budget exceeded" in refused.value.message

    async def over_grpc() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            try:
                await pb_grpc.InferenceStub(channel).Chat(
                    pb.ChatRequest(model="echo", messages=[pb.ChatMessage(role="user",
                                                                          content="over")]),
                    metadata=(("authorization", f"Bearer {key}"),), timeout=30)
            except grpc.aio.AioRpcError as error:
                return error
        raise AssertionError("the call was not refused")
    error = asyncio.run(over_grpc())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(error.trailing_metadata() or ())["error-code"] == "budget_exceeded"
    # Another key of the tenant is not held by this key's budget.
    admin = openai.OpenAI(base_url=live.base_url, api_key=payer.keys[Role.TENANT_ADMIN],
                          max_retries=0, timeout=30)
    assert admin.chat.completions.create(**body("fine")).choices[0].message.content == "fine"


async def _over_the_socket(key: str) -> list[dict[str, Any]]:
    """A chat request over the WebSocket transport (its own error frame)."""
    from streaming.pipeline.gateway import shared_gateway
    from tests.streaming.test_websocket import chat, frames_until, socket
    ws = socket(key)
    try:
        assert (await ws.connect())[0]
        await ws.send_to(text_data=chat("b1", "over"))
        return await frames_until(ws, {"b1"})
    finally:
        await ws.disconnect()
        await shared_gateway().close()
