"""The governance recorder's flushes when Redis applies a write but the reply never
arrives: the flush is retried, and what it carried counts once. Retried two ways:
redis-py sends the pipeline again at once (its default retry on a connection error), or,
with that retry off (or failing too), the recorder holds the flush and sends it with
its next one.

Between the recorder and the real Redis sits a TCP relay (tests/replycutter.py) that,
when told, passes a request on, waits for Redis' whole reply (so the writes are applied)
and then cuts the client's connection instead of delivering it: what a Redis restart or
a network failure after the write looks like from the gateway."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis
from django.conf import settings
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from governance import audit, breaker, ratelimit, signals, usage
from governance.models import AuditEvent, BreakerPolicy
from governance.recorder import CORRECT_LUA, LATENCIES_LUA, OUTCOMES_LUA, Recorder
from sluice.redis import reconnecting, sync_client
from tenants.roles import Role
from tests.conftest import RELAYED, make_org, principal_for
from tests.replycutter import ReplyCutter

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.cluster]


def flush_cut_then_retried(retries: bool, before: Callable[[Recorder], None],
                           after: Callable[[Recorder], None],
                           when_cut: Callable[[], None] = lambda: None) -> int:
    """`before` records into a flush whose reply the relay cuts (Redis applied it), then
    `when_cut` runs and `after` records more, and the next flush goes out: the cut one
    was sent again by redis-py's retry at once (`retries`), or is held and sent with this
    one (no retry). Returns the relay's cuts."""
    url = urlsplit(str(settings.REDIS_URL))

    async def scenario() -> int:
        cutter = ReplyCutter(url.hostname or "127.0.0.1", url.port or 6379)
        port = await cutter.start()
        client = aioredis.Redis(host="127.0.0.1", port=port, db=int(url.path[1:] or 0),
                                socket_timeout=5, **reconnecting(),
                                **({} if retries else {"retry": Retry(NoBackoff(), 0)}))
        recorder = Recorder(client, lambda _name: None)
        try:
            await client.ping()  # connected: the cut falls on the flush, not the hello
            before(recorder)
            cutter.cut = True
            await recorder.flush()  # applied by Redis, the reply lost
            assert cutter.cuts == 1
            when_cut()
            after(recorder)
            await recorder.flush()
            return cutter.cuts
        finally:
            await client.aclose()
            await cutter.close()

    return asyncio.run(scenario())


@RELAYED
@pytest.mark.parametrize("retries", [True, False], ids=["redis-py retries", "held"])
def test_a_flush_applied_with_its_reply_lost_counts_usage_and_audit_once(
        retries: bool) -> None:
    org = make_org("recorded", [Role.DEVELOPER])
    principal = principal_for(org.members[Role.DEVELOPER])
    tenant = principal.tenant_slug
    rds = sync_client(settings.REDIS_URL)
    rds.delete(audit.STREAM)
    rds.script_load(usage.COUNT_LUA)  # so the cut flush runs it (no NOSCRIPT first)
    day = datetime.now(UTC).date().isoformat()
    rds.delete(usage.usage_key(tenant, day))  # an earlier run's counts (same tenant)

    def event(text: str) -> dict:
        return audit.call_event(principal=principal, action="chat.completions",
                                model="echo", protocol="rest", status=200, latency_ms=1.0,
                                request_text=text)

    def first(recorder: Recorder) -> None:
        recorder.count_usage(tenant=tenant, model="echo", key_prefix="sk-a", prompt=3,
                             completion=5)
        recorder.audit(event("first call"))

    def second(recorder: Recorder) -> None:
        recorder.count_usage(tenant=tenant, model="echo", key_prefix="sk-a", prompt=1,
                             completion=1)
        recorder.audit(event("second call"))

    assert flush_cut_then_retried(retries, first, second) == 1
    counts = {k.decode(): int(v) for k, v in
              rds.hgetall(usage.usage_key(tenant, day)).items()}
    assert counts == {"echo|sk-a|r": 2, "echo|sk-a|p": 4, "echo|sk-a|c": 6}
    # The first call's event went onto the stream twice; it is stored once.
    on_stream = [audit.from_wire(fields[b"e"]) for _id, fields in
                 rds.xrange(audit.STREAM)]
    assert sorted(e["request_excerpt"] for e in on_stream) == [
        "first call", "first call", "second call"]
    audit.drain()
    stored = AuditEvent.objects.filter(chain=tenant).order_by("seq")
    assert [e.request_excerpt for e in stored] == ["first call", "second call"]
    assert audit.verify(tenant) == []
    rds.close()


@RELAYED
def test_a_flushs_token_bucket_corrections_are_summed_into_one_call_per_tenant() -> None:
    """Thirty calls' corrections (refunds and overruns) to two tenants' buckets: one
    script call per tenant, and each bucket ends where one call per correction would
    have left it."""
    rds = sync_client(settings.REDIS_URL)
    url = urlsplit(str(settings.REDIS_URL))
    slow = 6e-4  # per minute: no refill worth counting during the test
    tenants = [f"sum-{i}-{datetime.now(UTC).timestamp()}" for i in range(2)]
    buckets = {t: [ratelimit.Bucket(ratelimit.bucket_key(t, 1, "tokens", s), "tokens",
                                    slow, 10_000.0) for s in ("tenant", "model")]
               for t in tenants}
    for t in tenants:  # each bucket starts 5,000 below full
        rds.eval(ratelimit.BUCKETS_LUA, 2, *[b.key for b in buckets[t]],
                 *ratelimit.args_for(buckets[t], [5000, 5000], "check"))
    corrections = [(-120 if i % 3 else 45) for i in range(30)]  # -2,265 each tenant
    rds.script_load(CORRECT_LUA)  # counted below: no NOSCRIPT and EVAL first

    async def scenario() -> int:
        relay = ReplyCutter(url.hostname or "127.0.0.1", url.port or 6379)
        port = await relay.start()
        client = aioredis.Redis(host="127.0.0.1", port=port, db=int(url.path[1:] or 0))
        recorder = Recorder(client, lambda _name: None)
        try:
            for cost in corrections:
                for t in tenants:
                    recorder.correct_buckets(t, buckets[t], cost)
            await recorder.flush()
            return relay.commands(b"EVALSHA") + relay.commands(b"EVAL")
        finally:
            await client.aclose()
            await relay.close()

    assert asyncio.run(scenario()) == len(tenants)
    for t in tenants:
        for bucket in buckets[t]:
            level = float(rds.hget(bucket.key, "v") or 0)
            assert level == pytest.approx(5000 - sum(corrections), abs=1.0)


@RELAYED
@pytest.mark.parametrize("retries", [True, False], ids=["redis-py retries", "held"])
def test_a_flushs_bucket_corrections_applied_with_the_reply_lost_count_once(
        retries: bool) -> None:
    """A refund to a tenant's token bucket in a flush whose reply was cut, then a debit
    in the next: the retried flush carries both, and the refund is applied once (twice,
    a tenant would get the tokens back twice)."""
    rds = sync_client(settings.REDIS_URL)
    rds.script_load(CORRECT_LUA)  # so the cut flush runs it (no NOSCRIPT first)
    tenant = f"refund-{datetime.now(UTC).timestamp()}"
    bucket = ratelimit.Bucket(ratelimit.bucket_key(tenant, 1, "tokens", "tenant"), "tokens",
                              6e-4, 10_000.0)  # no refill worth counting during the test
    rds.eval(ratelimit.BUCKETS_LUA, 1, bucket.key,
             *ratelimit.args_for([bucket], [5000], "check"))  # 5,000 below full

    def applied_once() -> None:
        assert float(rds.hget(bucket.key, "v") or 0) == pytest.approx(6000, abs=1.0)

    assert flush_cut_then_retried(
        retries, lambda recorder: recorder.correct_buckets(tenant, [bucket], -1000),
        lambda recorder: recorder.correct_buckets(tenant, [bucket], 300),
        applied_once) == 1
    assert float(rds.hget(bucket.key, "v") or 0) == pytest.approx(5700, abs=1.0)
    rds.close()


@RELAYED
@pytest.mark.parametrize("retries", [True, False], ids=["redis-py retries", "held"])
def test_a_flushs_breaker_outcomes_and_latencies_applied_with_the_reply_lost_count_once(
        retries: bool) -> None:
    """Two failed calls and their latencies in a flush whose reply was cut, one more in
    the next: the breaker's window holds three failures, not five (counted twice, the
    failures of a retried flush could open a breaker), and the latency histogram three
    calls."""
    rds = sync_client(settings.REDIS_URL)
    rds.script_load(LATENCIES_LUA)  # so the cut flush runs them (no NOSCRIPT first)
    rds.script_load(OUTCOMES_LUA)
    deployment = f"outcomes-{datetime.now(UTC).timestamp()}"
    policy = BreakerPolicy(window_kind="count", window_size=100, min_calls=100)

    def failed_call(recorder: Recorder) -> None:
        recorder.outcome(deployment, policy, breaker.Outcome.FAILURE, 12.0)
        recorder.latency(deployment, 12.0)

    def applied_once() -> None:
        assert rds.hget(breaker.keys(deployment)[0], "f") == b"2"

    def first(recorder: Recorder) -> None:
        failed_call(recorder)
        failed_call(recorder)

    assert flush_cut_then_retried(retries, first, failed_call, applied_once) == 1
    window = rds.hgetall(breaker.keys(deployment)[0])
    assert (window[b"c"], window[b"f"]) == (b"3", b"3")
    assert rds.llen(breaker.keys(deployment)[1]) == 3
    now = int(datetime.now(UTC).timestamp()) // signals.SLOT_S  # this slot, or the last
    assert sum(int(count) for slot in (now - 1, now) for count in
               rds.hgetall(signals.latency_key(deployment, slot)).values()) == 3
    rds.close()
