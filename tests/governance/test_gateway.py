"""Governance through the real pipeline: a live Sluice (uvicorn + workers), the official
openai SDK and httpx as clients, a second gateway process where sharing matters."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from django.conf import settings

from governance import live as live_state
from governance import usage
from governance.admission import Governor
from governance.models import BreakerPolicy, Quota, RateLimitPolicy, UsageRecord
from governance.services import publish_guard
from inference.client import InferenceClient
from inference.models import Deployment
from inference.spec import DeploymentSpec
from sluice.errors import DeadlineExceeded, Unavailable
from sluice.localinfra import free_port
from sluice.redis import sync_client
from tenants.models import ApiKey
from tenants.roles import Role
from tests.conftest import (
    RELAYED,
    Org,
    eventually,
    make_org,
    principal_for,
    process_env,
)
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("alice", [Role.TENANT_ADMIN, Role.DEVELOPER])


def sdk(live: Live, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=30)


def chat_body(text: str = "hello world!", model: str = "echo", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **kw}


async def fire(urls: list[str], key: str, n: int, body: dict[str, Any],
               concurrency: int = 50) -> list[httpx.Response]:
    """n POSTs spread over the gateways, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * len(urls))
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        async def one(i: int) -> httpx.Response:
            async with gate:
                return await client.post(f"{urls[i % len(urls)]}/chat/completions", json=body,
                                         headers={"Authorization": f"Bearer {key}"})
        return await asyncio.gather(*(one(i) for i in range(n)))


def wait_for(check: Any, timeout: float = 10.0, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


# -- rate limits ---------------------------------------------------------------------
def test_rate_limit_headers_and_429_for_the_sdk(live: Live, org: Org) -> None:
    RateLimitPolicy.objects.create(scope="tenant", tenant=org.tenant, requests_per_minute=60,
                                   burst_requests=2, tokens_per_minute=100_000)
    client = sdk(live, org.keys[Role.DEVELOPER])
    raw = client.chat.completions.with_raw_response.create(**chat_body())
    assert raw.headers["x-ratelimit-limit-requests"] == "60"
    assert raw.headers["x-ratelimit-remaining-requests"] == "1"
    assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
    assert raw.parse().choices[0].message.content == "hello world!"
    client.chat.completions.create(**chat_body())
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(**chat_body())
    err = caught.value
    assert err.status_code == 429 and err.code == "rate_limit_requests"
    assert 1 <= int(err.response.headers["retry-after"]) <= 2
    assert err.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert "requests per minute" in err.message


def test_each_key_has_its_own_bucket(live: Live, org: Org) -> None:
    RateLimitPolicy.objects.create(scope="api_key", tenant=org.tenant, requests_per_minute=60,
                                   burst_requests=1)
    dev = sdk(live, org.keys[Role.DEVELOPER])
    admin = sdk(live, org.keys[Role.TENANT_ADMIN])
    dev.chat.completions.create(**chat_body())
    with pytest.raises(openai.RateLimitError):
        dev.chat.completions.create(**chat_body())
    admin.chat.completions.create(**chat_body())  # another key, another bucket


def _gateway_process(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "sluice.root.asgi:application", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning", "--lifespan", "off"],
        cwd=REPO, env=process_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.fixture
def second_gateway(live: Live) -> Iterator[str]:
    port = free_port()
    proc = _gateway_process(port)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None

    assert wait_for(up, timeout=60, every=0.2)
    assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
    yield f"{base}/v1"
    proc.terminate()
    proc.wait(10)


def test_two_gateway_processes_share_one_exact_limit(live: Live, org: Org,
                                                     second_gateway: str) -> None:
    """A 100/min limit with a burst of 10, hammered through two gateway processes:
    at most 100 + burst per minute pass, never 200."""
    RateLimitPolicy.objects.create(scope="tenant", tenant=org.tenant, requests_per_minute=100,
                                   burst_requests=10)
    started = time.monotonic()
    responses = asyncio.run(fire([live.base_url, second_gateway], org.keys[Role.DEVELOPER],
                                 300, chat_body(), concurrency=30))
    elapsed = time.monotonic() - started
    codes = [r.status_code for r in responses]
    admitted = codes.count(200)
    assert set(codes) <= {200, 429}
    assert 10 <= admitted <= 10 + int(100 * elapsed / 60) + 1, (admitted, elapsed)
    # Both processes consulted the bucket (and refused): with a bucket each they would
    # have admitted a burst each, over the bound above.
    for gateway in (responses[0::2], responses[1::2]):
        assert 429 in {r.status_code for r in gateway}
    assert all(r.headers.get("x-ratelimit-limit-requests") == "100" for r in responses)
    print(f"two gateways: {admitted} of 300 admitted in {elapsed:.2f} s")


def test_adaptive_rate_is_visible_and_applied(live: Live, org: Org) -> None:
    policy = RateLimitPolicy.objects.create(scope="model", tenant=org.tenant, model="echo",
                                            requests_per_minute=600, adaptive=True)
    # No traffic yet: QPS 0 -> clamp(0/1000, 0.5, 2.0) = 0.5, no P99 -> x1.
    raw = sdk(live, org.keys[Role.DEVELOPER]).chat.completions.with_raw_response.create(
        **chat_body())
    assert raw.headers["x-ratelimit-limit-requests"] == "300"
    effective = live_state.effective_rates(policy)
    assert effective[0]["model"] == "echo" and effective[0]["factor"] == 0.5
    assert effective[0]["requests_per_minute"] == 300


def test_rate_limit_without_redis_follows_fail_open(live: Live, org: Org) -> None:
    spec = DeploymentSpec.from_json(Deployment.objects.get(name="echo").to_spec().to_json())
    principal = principal_for(org.members[Role.DEVELOPER])
    policy = RateLimitPolicy.objects.create(scope="tenant", tenant=org.tenant,
                                            requests_per_minute=10, fail_open=True)

    async def admit() -> Any:
        client = InferenceClient("redis://127.0.0.1:1/0")  # nothing listens there
        try:
            return await Governor(client).admit(principal, spec, tokens=10)
        finally:
            await client.close()

    from governance import cache as policy_cache
    policy_cache.clear()
    admitted = asyncio.run(admit())
    assert admitted.headers["x-ratelimit-status"] == "unavailable"
    policy.fail_open = False
    policy.save()
    policy_cache.clear()
    with pytest.raises(Unavailable) as caught:
        asyncio.run(admit())
    assert caught.value.code == "rate_limit_unavailable"
    policy.delete()
    Quota.objects.create(tenant=org.tenant, max_tokens=1000, shadow=True)
    policy_cache.clear()
    asyncio.run(admit())  # shadow quotas never refuse, not even blind
    Quota.objects.create(tenant=org.tenant, max_tokens=1000)
    policy_cache.clear()
    with pytest.raises(Unavailable) as caught:
        asyncio.run(admit())
    assert caught.value.code == "quota_unavailable"  # quotas fail closed


# -- quotas --------------------------------------------------------------------------
def test_200_concurrent_calls_never_overspend_a_token_quota(live: Live, org: Org) -> None:
    quota = Quota.objects.create(tenant=org.tenant, model="echo", max_tokens=2000)
    responses = asyncio.run(fire([live.base_url], org.keys[Role.DEVELOPER], 200,
                                 chat_body("hello world!", max_tokens=12), concurrency=200))
    ok = [r.json() for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == 200
    spent = sum(r["usage"]["total_tokens"] for r in ok)
    assert 0 < spent <= 2000
    assert refused and refused[0].json()["error"]["type"] == "insufficient_quota"
    use = wait_for(lambda: (u := live_state.quota_use(quota)).open_reservations == 0 and u)
    assert use and use.tokens == spent and use.requests == len(ok)


def test_quota_refusal_says_which_quota_and_when_it_resets(live: Live, org: Org) -> None:
    quota = Quota.objects.create(tenant=org.tenant, model="echo", period="minute",
                                 max_requests=1)
    client = sdk(live, org.keys[Role.DEVELOPER])
    client.chat.completions.create(**chat_body())
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(**chat_body())
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] == "quota_exceeded" and body["type"] == "insufficient_quota"
    assert body["quota"]["id"] == quota.pk and body["quota"]["metric"] == "requests"
    assert body["quota"]["limit"] == 1 and body["quota"]["resets_at"]
    assert "requests per minute for model 'echo' is 1" in body["message"]
    assert 1 <= int(caught.value.response.headers["retry-after"]) <= 60
    sdk(live, org.keys[Role.DEVELOPER]).embeddings.create(model="minilm", input="other model")


def test_shadow_quota_counts_but_admits(live: Live, org: Org) -> None:
    quota = Quota.objects.create(tenant=org.tenant, max_requests=1, shadow=True)
    client = sdk(live, org.keys[Role.DEVELOPER])
    client.chat.completions.create(**chat_body())
    raw = client.chat.completions.with_raw_response.create(**chat_body())
    assert raw.headers["x-sluice-quota-shadow"] == f"{quota.pk}:requests"
    assert wait_for(lambda: live_state.quota_use(quota).requests == 2)


def test_cancelled_stream_releases_its_reservation(live: Live, org: Org,
                                                   settings: Any) -> None:
    settings.SLUICE_STREAM_RESUME_GRACE_S = 0.2
    quota = Quota.objects.create(tenant=org.tenant, model="slow-echo", max_concurrent=1,
                                 max_tokens=100_000)
    text = "x" * 300  # 300 tokens at 50 ms each: 15 s if nobody cancels
    key = org.keys[Role.DEVELOPER]
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"{live.base_url}/chat/completions",
            json=chat_body(text, model="slow-echo", stream=True),
            headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [line for _, line in zip(range(6), lines, strict=False)]
        assert any(line.startswith("data:") for line in got)
        assert live_state.quota_use(quota).open_reservations == 1
    # the client left: after the resume grace the generation is cancelled and settled
    use = wait_for(lambda: (u := live_state.quota_use(quota)).open_reservations == 0 and u,
                   timeout=10)
    assert use, "the reservation was not released"
    assert 0 < use.tokens < 300 + 300  # billed what was made, not the whole reservation
    sdk(live, key).chat.completions.create(**chat_body(model="slow-echo"))  # not 429


# -- breakers, memory, shedding ------------------------------------------------------
def _breaker(name: str, **fields: Any) -> BreakerPolicy:
    dep = Deployment.objects.get(name=name)
    row, _ = BreakerPolicy.objects.update_or_create(deployment=dep, defaults=fields)
    from governance import cache as policy_cache
    policy_cache.clear()
    return row


def test_open_breaker_refuses_then_a_probe_closes_it(live: Live, org: Org) -> None:
    from governance import breaker
    from governance.breaker import Outcome
    # open for 3 s: with 0.5 s, a loaded machine's stall before the first call let it in
    # as the probe (the cluster pass's failure at 7ebe71f)
    policy = _breaker("echo", min_calls=1, window_size=1, open_wait_s=3, half_open_probes=1)
    r = sync_client(settings.REDIS_URL)
    r.eval(breaker.RECORD_LUA, 4, *breaker.keys("echo"),
           *breaker.record_args("", [(Outcome.FAILURE, 10)], policy))
    opened = time.monotonic()  # the breaker opened before this: its wait ends by +3 s
    time.sleep(0.25)  # gateways re-ask a breaker they saw closed after 0.2 s
    client = sdk(live, org.keys[Role.DEVELOPER])
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**chat_body())
    assert caught.value.status_code == 503 and caught.value.code == "circuit_open"
    assert 1 <= int(caught.value.response.headers["retry-after"]) <= 3
    time.sleep(max(0.0, opened + 3.05 - time.monotonic()))  # the breaker's own clock
    client.chat.completions.create(**chat_body())  # the probe, and it succeeds
    assert wait_for(lambda: live_state.breaker_state(policy)["state"] == "closed")
    client.chat.completions.create(**chat_body())


@RELAYED
def test_concurrent_calls_share_one_read_of_a_closed_breaker(live: Live, org: Org) -> None:
    """At a burst, one read of a closed breaker serves every call (a read per call had
    been a quarter of the script calls at 64 connections); a breaker that is not closed
    still gives each call its own verdict."""
    from governance import breaker
    from governance.breaker import Outcome
    from inference.spec import RuntimeName
    from tests.replycutter import ReplyCutter
    spec = DeploymentSpec(f"breaker-{time.monotonic_ns()}", RuntimeName.ECHO)
    principal = principal_for(org.members[Role.DEVELOPER])
    r = sync_client(settings.REDIS_URL)
    url = r.connection_pool.connection_kwargs

    async def scenario() -> tuple[int, int, int, list[str]]:
        relay = ReplyCutter(url.get("host", "127.0.0.1"), int(url.get("port", 6379)))
        port = await relay.start()
        client = InferenceClient(f"redis://127.0.0.1:{port}/{url.get('db', 0)}")
        governor = Governor(client)

        async def admit() -> str:
            try:
                adm = await governor.admit(principal, spec, tokens=10)
            except Unavailable as refused:
                return refused.code or ""
            await adm.release()
            return "admitted"

        try:
            closed = await asyncio.gather(*[admit() for _ in range(50)])
            reads = relay.commands(b"HMGET")
            admits = relay.commands(b"EVALSHA") + relay.commands(b"EVAL")
            r.eval(breaker.RECORD_LUA, 4, *breaker.keys(spec.name),
                   *breaker.record_args("", [(Outcome.FAILURE, 10)],
                                        BreakerPolicy(min_calls=1, window_size=1)))
            await asyncio.sleep(0.25)  # the state read above expires
            before = relay.commands(b"EVALSHA")
            opened = await asyncio.gather(*[admit() for _ in range(20)])
            return reads, admits, relay.commands(b"EVALSHA") - before, closed + opened
        finally:
            await governor.close()
            await client.close()
            await relay.close()
            r.delete(*breaker.keys(spec.name))

    reads, admits, open_verdicts, outcomes = asyncio.run(scenario())
    assert outcomes[:50] == ["admitted"] * 50
    assert (reads, admits) == (1, 0), "50 concurrent calls share one read of the state"
    assert outcomes[50:] == ["circuit_open"] * 20
    assert open_verdicts == 20, "an open breaker gives each call its own verdict"


def test_caller_deadlines_never_count_and_one_tenant_cannot_open_it_for_others(
        live: Live, org: Org) -> None:
    """A deadline the caller chose expiring (gateway- or worker-side) is not the
    deployment's failure; the platform's is. Failures of one tenant alone, while another
    tenant's calls succeed, refuse that tenant only."""
    from governance import breaker
    from inference.spec import RuntimeName
    spec = DeploymentSpec(f"deadline-{time.monotonic_ns()}", RuntimeName.ECHO)
    alice = principal_for(org.members[Role.DEVELOPER])
    bob = principal_for(make_org("bob", [Role.DEVELOPER]).members[Role.DEVELOPER])
    r = sync_client(settings.REDIS_URL)
    policy = breaker.default_policy(0)
    worker_504: Any = {"t": "error", "seq": 0, "status": 504, "code": "deadline_exceeded",
                       "message": "The request's deadline passed while it was queued.",
                       "usage": {"prompt_tokens": 0, "completion_tokens": 0}}

    def peek() -> breaker.Snapshot:
        return breaker.Snapshot.from_reply(r.eval(breaker.PEEK_LUA, 4, *breaker.keys(spec.name),
                                                  *breaker.peek_args(policy)))

    async def scenario() -> None:
        client = InferenceClient(settings.REDIS_URL)
        governor = Governor(client)

        async def call(who: Any, *, caller_deadline: bool, **finish: Any) -> bool:
            adm = await governor.admit(who, spec, tokens=10)
            adm.caller_deadline = caller_deadline
            await adm.finish(None, **finish) if "error" in finish else \
                await adm.finish(finish["final"])
            return adm.probe

        try:
            # 60 of alice's calls end at her own short deadline, at the gateway or the worker
            for i in range(60):
                await call(alice, caller_deadline=True,
                           **({"error": DeadlineExceeded("deadline")} if i % 2
                              else {"final": worker_504}))
            await governor.recorder.flush()
            assert (peek().state, peek().calls) == (breaker.State.CLOSED, 0)
            assert not await call(bob, caller_deadline=False, final=worker_504 | {
                "t": "done", "status": 200, "finish": "stop"})
            # the platform's deadline is the deployment's failure: alice's refuse her alone
            for _ in range(policy.min_calls):
                await call(alice, caller_deadline=False, error=DeadlineExceeded("deadline"))
            await governor.recorder.flush()
            snap = peek()
            assert (snap.state, snap.tenants_open) == (breaker.State.CLOSED, ("alice",))
            await asyncio.sleep(0.25)  # the closed state the gateway saw expires
            with pytest.raises(Unavailable) as refused:
                await call(alice, caller_deadline=False, final=worker_504)
            assert refused.value.code == "circuit_open"
            assert not await call(bob, caller_deadline=False, error=Unavailable("x"))
        finally:
            await governor.close()
            await client.close()
            r.delete(*breaker.keys(spec.name))

    asyncio.run(scenario())


def _rotation(name: str) -> list[bool]:
    client = sync_client(settings.REDIS_URL)
    from inference.worker import heartbeats
    return [b.get("in_rotation", True) for b in heartbeats(client, name).values()]


def test_memory_guard_takes_workers_out_and_gateways_degrade(live: Live, org: Org) -> None:
    policy = _breaker("echo", memory_high=0.0002, memory_low=0.0001, memory_hold_s=0,
                      degrade_mode="shorten", degraded_max_tokens=3)
    publish_guard(policy)
    assert wait_for(lambda: _rotation("echo") == [False], timeout=5)
    time.sleep(0.3)  # the gateways' picture of the workers is at most 0.25 s old
    client = sdk(live, org.keys[Role.DEVELOPER])
    raw = client.chat.completions.with_raw_response.create(**chat_body("a longer prompt"))
    assert raw.headers["x-sluice-degraded"] == "memory"
    reply = raw.parse()
    assert reply.choices[0].message.content == "a l" and reply.choices[0].finish_reason == "length"
    _breaker("echo", degrade_mode="reject", memory_hold_s=3)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**chat_body())
    assert caught.value.status_code == 503 and caught.value.code == "memory_pressure"
    assert caught.value.response.headers["retry-after"] == "3"
    publish_guard(_breaker("echo", memory_high=0.99, memory_low=0.98, memory_hold_s=0))
    assert wait_for(lambda: _rotation("echo") == [True], timeout=5)
    time.sleep(0.3)
    assert client.chat.completions.create(**chat_body()).choices[0].message.content == \
        "hello world!"


def test_load_shedding_keeps_room_for_priority_traffic(live: Live, org: Org) -> None:
    _breaker("slow-echo", shed_queue_depth=2, priority_share=0.5)
    tenant_admin = principal_for(org.members[Role.TENANT_ADMIN])
    from tenants.services import apikey_create
    vip = apikey_create(actor=tenant_admin, name="vip", priority=5).secret
    key = org.keys[Role.DEVELOPER]
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"{live.base_url}/chat/completions",
            json=chat_body("y" * 100, model="slow-echo", stream=True),
            headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200
        time.sleep(0.3)  # depth 1 is now in every gateway's picture
        normal = client.post(f"{live.base_url}/chat/completions",
                             json=chat_body("n", model="slow-echo"),
                             headers={"Authorization": f"Bearer {key}"})
        assert normal.status_code == 503 and normal.json()["error"]["code"] == "load_shed"
        priority = client.post(f"{live.base_url}/chat/completions",
                               json=chat_body("p", model="slow-echo"),
                               headers={"Authorization": f"Bearer {vip}"})
        assert priority.status_code == 200, priority.text
    assert ApiKey.objects.get(prefix=vip.split("-")[2]).priority == 5


# -- usage ---------------------------------------------------------------------------
def test_usage_is_counted_and_rolled_up_idempotently(live: Live, org: Org) -> None:
    client = sdk(live, org.keys[Role.DEVELOPER])
    for text in ("one", "three"):
        client.chat.completions.create(**chat_body(text))
    client.embeddings.create(model="minilm", input=["a b c"])
    def counted() -> bool:  # the gateway writes its usage counters every 0.1 s
        usage.rollup()
        rows = {r.model: r.requests for r in UsageRecord.objects.filter(tenant=org.tenant)}
        return rows.get("echo") == 2 and rows.get("minilm") == 1

    eventually(counted, 10, what="the gateway's usage counters")
    assert usage.rollup() >= 2
    assert usage.rollup() >= 2  # again: the same totals, not doubled
    rows = {r.model: r for r in UsageRecord.objects.filter(tenant=org.tenant)}
    assert rows["echo"].requests == 2
    assert rows["echo"].prompt_tokens == len("one") + len("three")
    assert rows["echo"].completion_tokens == len("one") + len("three")
    assert rows["echo"].key_prefix == ApiKey.objects.get(
        tenant=org.tenant, role=Role.DEVELOPER).prefix
    assert rows["minilm"].requests == 1 and rows["minilm"].prompt_tokens > 0


def test_the_reply_does_not_wait_for_settlement_and_audit(live: Live, org: Org) -> None:
    """A call's settlement, audit event and metrics (~0.15 ms of CPU) run at the event
    loop's next turn after its events end, so the adapter writes the reply first; they
    do run then, and the call's recorded duration ends with its events, not when they
    run (here 0.3 s later)."""
    from governance import audit
    from streaming.apis import chat_request
    from streaming.pipeline.gateway import Gateway
    principal = principal_for(org.members[Role.DEVELOPER])

    async def scenario() -> tuple[bool, bool, str, list[float]]:
        gateway = Gateway()
        try:
            sub = await gateway.chat(principal, chat_request.call_request(
                chat_request.parsed(chat_body("hello"))))
            recorder = gateway.governor.recorder
            held = recorder._pending  # where this call's audit event goes (or the next)
            events = [event async for event in sub.events()]
            at_end = sub.admission.done
            time.sleep(0.3)  # the loop held up: the settlement runs 0.3 s after the end
            await asyncio.sleep(0)  # the loop's next turn
            latencies = [audit.from_wire(wire)["latency_ms"]
                         for pending in {id(held): held, id(recorder._pending):
                                         recorder._pending}.values()
                         for wire in pending.audit]
            return at_end, sub.admission.done, events[-1]["t"], latencies
        finally:
            await gateway.close()

    at_end, after_a_turn, last, latencies = asyncio.run(scenario())
    assert last == "done"
    assert not at_end, "settled before the adapter could write the reply"
    assert after_a_turn, "not settled at the loop's next turn"
    assert len(latencies) == 1 and latencies[0] < 300, latencies


# -- audit ---------------------------------------------------------------------------
def test_calls_are_refused_not_served_unaudited_while_the_audit_log_cannot_keep_up(
        live: Live, org: Org, settings: Any) -> None:
    """No audit writer runs here: once SLUICE_AUDIT_REFUSE_AT events wait in the stream,
    calls get a retriable 503 `audit_unavailable` (the stream's bound would otherwise
    trim the oldest events away), the refusals add nothing to the backlog, and once the
    events are written calls are served again, every served call in the audit log."""
    from governance import audit
    from governance.models import AuditEvent
    audit.drain()
    settings.SLUICE_AUDIT_REFUSE_AT = 20
    rds = sync_client(settings.REDIS_URL)
    client = sdk(live, org.keys[Role.DEVELOPER])

    def call() -> openai.APIStatusError | None:
        try:
            client.chat.completions.create(**chat_body("keep a record"))
        except openai.APIStatusError as exc:
            return exc
        return None

    served, refused = 0, None
    deadline = time.monotonic() + 20
    while refused is None and time.monotonic() < deadline:
        refused = call()
        served += refused is None
    assert refused is not None, "never refused"
    assert refused.status_code == 503 and refused.code == "audit_unavailable", refused
    assert refused.response.headers["retry-after"] == "5"
    assert served >= 20
    # The last served calls' events reach the stream (0.1 s flushes).
    backlog = eventually(lambda: rds.xlen(audit.STREAM) >= served and rds.xlen(audit.STREAM),
                         10, what="the served calls' audit events")
    assert backlog >= 20
    for _ in range(5):
        again = call()
        assert again is not None and again.code == "audit_unavailable"
    time.sleep(0.5)
    assert rds.xlen(audit.STREAM) == backlog, "a refusal added to what cannot be written"
    audit.drain()
    assert wait_for(lambda: call() is None, timeout=5), "still refused once written"
    audit.drain()
    assert AuditEvent.objects.filter(tenant=org.tenant, action="chat.completions",
                                     status=200).count() == served + 1
    assert not AuditEvent.objects.filter(tenant=org.tenant, status=503).exists()
