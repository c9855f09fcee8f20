"""The Redis batching queue with real Redis, the real gateway client and workers running
the echo and tiny runtimes: batching by size and time, deadlines, priority, fairness,
cancellation, bounds, idempotency, resume, heartbeats."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from inference import queue as q
from inference.client import InferenceClient, RequestHandle
from inference.engine.entries import Pending
from inference.engine.intake import Intake
from inference.engine.writer import Writer
from inference.jobs import FINAL_EVENTS, ChatJob, EmbedJob, Event, encode_event
from inference.runtimes.echo import EchoRuntime
from inference.spec import DeploymentSpec, RuntimeName
from inference.worker import Worker, heartbeats
from sluice.errors import DeadlineExceeded, RateLimited, Unavailable
from tests.conftest import RELAYED
from tests.inference.conftest import Result, chat, collect, run, unique
from tests.replycutter import ReplyCutter

pytestmark = pytest.mark.cluster

StartWorker = Callable[..., Worker]


def echo(**kw: Any) -> DeploymentSpec:
    return DeploymentSpec(unique("echo"), RuntimeName.ECHO, **kw)


def test_a_full_batch_forms_without_waiting_for_max_wait(
        thread_worker: StartWorker, redis_url: str, rds: redis.Redis) -> None:
    spec = echo(max_batch_size=4, max_wait_ms=3000)

    async def go(client: InferenceClient) -> float:
        handles = [await client.submit(spec, tenant="t", job=chat(f"m{i}")) for i in range(4)]
        worker = thread_worker(spec)
        started = time.monotonic()
        results = await asyncio.gather(*[collect(h) for h in handles])
        assert [r.text for r in results] == [f"m{i}" for i in range(4)]
        assert sorted(worker.admitted[0]) == sorted(h.rid for h in handles)
        return time.monotonic() - started

    assert run(go, redis_url) < 2.0, "a full batch must not wait for max_wait_ms"


def test_a_lone_chat_request_starts_at_once_and_a_later_one_joins_its_batch(
        thread_worker: StartWorker, redis_url: str) -> None:
    """Continuous batching: an idle chat worker does not hold a request for max_wait_ms;
    one that arrives during the generation joins the running batch (it finishes long
    before the first one would have) within max_wait_ms. (max_wait_ms is long, a second,
    so that "did not wait for it" stays true on a loaded machine: at 150 ms a busy box's
    scheduling alone had crossed the line.)"""
    spec = echo(max_batch_size=8, max_wait_ms=1000, echo_token_delay_ms=20)
    worker = thread_worker(spec)

    async def timed(handle: RequestHandle) -> tuple[float, Result]:
        events, first = [], 0.0
        async for event in handle.events():
            if event["t"] == "delta" and not first:
                first = time.monotonic()
            events.append(event)
        return first, Result("".join(e.get("text", "") for e in events if e["t"] == "delta"),
                             events)

    async def go(client: InferenceClient) -> None:
        await asyncio.sleep(0.3)  # the worker is blocking on an empty stream
        t0 = time.monotonic()
        first = await client.submit(spec, tenant="t", job=chat("x" * 200))  # ~4 s
        long_one = asyncio.create_task(timed(first))
        await asyncio.sleep(0.2)
        t1 = time.monotonic()
        second = await client.submit(spec, tenant="t", job=chat("two"))
        b = await collect(second)
        assert b.text == "two"
        assert time.monotonic() - t1 < 1.5, "the newcomer joins within max_wait_ms"
        assert not long_one.done(), "the second one ran beside the first, not after it"
        first_token, a = await long_one
        assert a.text == "x" * 200
        assert first_token - t0 < 0.6, "a lone chat request must not wait max_wait_ms"
        assert [sorted(b) for b in list(worker.admitted)[:2]] == [[first.rid], [second.rid]]

    run(go, redis_url)


def test_a_partial_embedding_batch_waits_for_max_wait_then_runs(
        thread_worker: StartWorker, redis_url: str) -> None:
    from inference.weights import MINILM

    spec = DeploymentSpec(unique("minilm"), RuntimeName.ENCODER, weights=MINILM,
                          max_batch_size=8, max_wait_ms=400)
    worker = thread_worker(spec)

    async def go(client: InferenceClient) -> None:
        await asyncio.sleep(0.3)  # worker is blocking on an empty stream
        first = await client.submit(spec, tenant="t", job=EmbedJob(input=["one"]))
        await asyncio.sleep(0.1)  # arrives inside the first one's max_wait window
        second = await client.submit(spec, tenant="t", job=EmbedJob(input=["two"]))
        t0 = time.monotonic()
        a, b = await asyncio.gather(collect(first), collect(second))
        assert a.final["t"] == b.final["t"] == "done"
        assert time.monotonic() - t0 > 0.15  # it did wait for more
        assert sorted(worker.admitted[0]) == sorted([first.rid, second.rid])

    run(go, redis_url)


def test_deadline_passed_in_queue_is_answered_504_without_running(
        thread_worker: StartWorker, redis_url: str) -> None:
    spec = echo(max_batch_size=1, echo_token_delay_ms=20)

    async def go(client: InferenceClient) -> None:
        busy = await client.submit(spec, tenant="t", job=chat("x" * 40))
        late = await client.submit(spec, tenant="t", job=chat("late"), timeout_s=0.3)
        worker = thread_worker(spec)
        result = await collect(late)
        assert result.final["t"] == "error" and result.final["status"] == 504
        assert result.final["code"] == "deadline_exceeded"
        assert result.text == ""
        assert (await collect(busy)).text == "x" * 40
        assert all(late.rid not in batch for batch in worker.admitted)

    run(go, redis_url)


def test_gateway_gives_up_at_deadline_when_no_worker_answers(redis_url: str,
                                                             rds: redis.Redis) -> None:
    spec = echo()

    async def go(client: InferenceClient) -> None:
        handle = await client.submit(spec, tenant="t", job=chat("nobody home"), timeout_s=0.2)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await collect(handle)
        assert time.monotonic() - t0 < 5
        assert rds.sismember(q.cancel_key(spec.name), handle.rid), "worker must learn to skip it"

    run(go, redis_url)


def test_priority_and_tenant_fairness(thread_worker: StartWorker, redis_url: str) -> None:
    spec = echo(max_batch_size=1, echo_token_delay_ms=5, max_queue_depth=100,
                tenant_queue_share=0.9)

    async def go(client: InferenceClient) -> None:
        flood = [await client.submit(spec, tenant="alice", job=chat(f"a{i}")) for i in range(20)]
        single = await client.submit(spec, tenant="bob", job=chat("b"))
        urgent = await client.submit(spec, tenant="alice", job=chat("urgent"), priority=10)
        worker = thread_worker(spec)
        await asyncio.gather(*[collect(h) for h in [*flood, single, urgent]])
        order = [rid for batch in worker.admitted for rid in batch]
        # The worker reads a window (2 x batch size) at a time, so "first" means within
        # the first window or two, not after the 20 queued before.
        assert order.index(urgent.rid) <= 4, order
        assert order.index(single.rid) <= 4, order

    run(go, redis_url)


def test_cancellation_stops_generation_and_bills_tokens_produced(
        thread_worker: StartWorker, redis_url: str) -> None:
    spec = echo(echo_token_delay_ms=20)
    worker = thread_worker(spec)

    async def go(client: InferenceClient) -> None:
        handle = await client.submit(spec, tenant="t", job=chat("z" * 200, max_tokens=500))
        events = []
        async for event in handle.events():
            events.append(event)
            if len(events) == 3:
                await handle.cancel()
        final = events[-1]
        assert final["t"] == "done" and final["finish"] == "cancelled"
        produced = final["usage"]["completion_tokens"]
        assert 3 <= produced < 200
        assert len("".join(e.get("text", "") for e in events)) == produced
        await asyncio.sleep(0.2)
        assert not worker.active, "the worker stopped generating"

    run(go, redis_url)


def test_a_caller_that_leaves_while_its_enqueue_is_in_flight_leaves_nothing_running(
        thread_worker: StartWorker, redis_url: str, rds: redis.Redis) -> None:
    """A client that disconnects while its request is being enqueued cancels the task
    calling submit() after the enqueue left for Redis: the request is queued with no
    one waiting. It must be cancelled, not generated in full for nobody (and unbilled:
    the gateway released the admission), and its idempotency key freed."""
    spec = echo(echo_token_delay_ms=20)  # 200 tokens: 4 s if it ran
    worker = thread_worker(spec)

    async def go(client: InferenceClient) -> None:
        await client.start()
        submitting = asyncio.create_task(
            client.submit(spec, tenant="t", job=chat("z" * 200, stream=False),
                          idempotency_key="left"))
        while not client.scripts._queued:  # until submit() handed over its enqueue
            await asyncio.sleep(0)
        submitting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submitting
        finals: list[dict[str, Any]] = []
        deadline = time.monotonic() + 2
        while not finals and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            for key in rds.scan_iter(q.out_key("t", "*")):
                events = [json.loads(f[b"e"]) for _id, f in rds.xrange(key)]
                finals += [e for e in events if e["t"] in FINAL_EVENTS]
        assert finals, "the request was queued and must end within moments"
        assert finals[0]["finish"] == "cancelled"
        assert finals[0]["usage"]["completion_tokens"] < 50
        assert not worker.active
        # A retry with the same idempotency key runs afresh: nothing replays the cancel.
        retry = await client.submit(spec, tenant="t", job=chat("again", stream=False),
                                    idempotency_key="left")
        assert not retry.replayed
        assert (await collect(retry)).text == "again"

    run(go, redis_url)


@RELAYED
def test_an_enqueue_whose_reply_is_lost_fails_retriably_and_leaves_nothing_running(
        thread_worker: StartWorker, redis_url: str, rds: redis.Redis) -> None:
    """Redis applies the enqueue and the reply is lost with the connection. The gateway's
    pool does not send it again (no retries: a repeat could queue it twice); the caller
    gets a RedisError (the adapters answer 503, retriable) and the request Redis did
    queue is cancelled, not generated for nobody. Its idempotency key is freed."""
    spec = echo(echo_token_delay_ms=20)  # 200 tokens: 4 s if it ran
    rds.script_load(q.ENQUEUE_LUA)  # so the cut call is the enqueue itself (no NOSCRIPT)
    url = urlsplit(redis_url)

    async def scenario() -> list[dict[str, Any]]:
        cutter = ReplyCutter(url.hostname or "127.0.0.1", url.port or 6379,
                             match=b"EVALSHA")
        port = await cutter.start()
        client = InferenceClient(f"redis://127.0.0.1:{port}/{url.path[1:] or 0}")
        await client.start()
        try:
            cutter.cut = True
            with pytest.raises(redis.RedisError):
                await client.submit(spec, tenant="t", job=chat("z" * 200, stream=False),
                                    idempotency_key="lost")
            assert cutter.cuts == 1
            queued = rds.xrange(q.stream_key(spec.name, q.stream_suffix("t", 0)))
            assert len(queued) == 1, "Redis applied the enqueue once"
            rid = queued[0][1][b"rid"].decode()
            thread_worker(spec)
            events = [e async for e in client.replay("t", rid, timeout_s=5)]
            assert rds.get(q.idem_key("t", "lost")) is None
            retry = await client.submit(spec, tenant="t", job=chat("again", stream=False),
                                        idempotency_key="lost")
            assert (await collect(retry)).text == "again"
            return events
        finally:
            await client.close()
            await cutter.close()

    events = asyncio.run(scenario())
    assert events and events[-1]["t"] == "done" and events[-1]["finish"] == "cancelled"
    assert events[-1]["usage"]["completion_tokens"] < 50


def test_queue_is_bounded_and_tenant_share_is_enforced(redis_url: str,
                                                       rds: redis.Redis) -> None:
    spec = echo(max_queue_depth=4, tenant_queue_share=0.5)

    async def go(client: InferenceClient) -> None:
        await client.submit(spec, tenant="a", job=chat("1"))
        await client.submit(spec, tenant="a", job=chat("2"))
        with pytest.raises(RateLimited) as tenant_full:
            await client.submit(spec, tenant="a", job=chat("3"))
        assert tenant_full.value.headers["Retry-After"]
        await client.submit(spec, tenant="b", job=chat("1"))
        await client.submit(spec, tenant="c", job=chat("1"))
        t0 = time.monotonic()
        with pytest.raises(Unavailable) as full:
            await client.submit(spec, tenant="d", job=chat("1"))
        assert time.monotonic() - t0 < 0.5, "rejection is immediate, never a wait"
        assert full.value.status == 503 and full.value.headers["Retry-After"]
        assert int(rds.get(q.depth_key(spec.name))) == 4
        stats = await client.queue_stats(spec.name)
        assert stats["depth"] == 4 and 0 <= stats["oldest_age_ms"] < 10_000

    run(go, redis_url)


def test_idempotency_key_gives_one_generation(thread_worker: StartWorker, redis_url: str,
                                              rds: redis.Redis) -> None:
    spec = echo()
    thread_worker(spec)

    async def go(client: InferenceClient) -> None:
        first = await client.submit(spec, tenant="t", job=chat("once"), idempotency_key="k1")
        a = await collect(first)
        again = await client.submit(spec, tenant="t", job=chat("once"), idempotency_key="k1")
        b = await collect(again)
        assert again.rid == first.rid and a.text == b.text == "once"
        assert a.final == b.final

    run(go, redis_url)
    assert int(rds.get(q.depth_key(spec.name)) or 0) == 0


def test_a_non_streamed_reply_comes_in_one_piece_a_streamed_one_token_by_token(
        thread_worker: StartWorker, redis_url: str, rds: redis.Redis) -> None:
    spec = echo()
    thread_worker(spec)

    async def go(client: InferenceClient) -> None:
        whole = await client.submit(spec, tenant="t", job=chat("hello", stream=False))
        parts = await client.submit(spec, tenant="t", job=chat("hello", stream=True))
        a, b = await collect(whole), await collect(parts)
        assert a.text == b.text == "hello"
        assert [e["t"] for e in a.events] == ["delta", "done"]
        assert a.events[0]["ids"] == list(b"hello")
        assert [e["t"] for e in b.events] == ["delta"] * 5 + ["done"]
        for usage in (dict(a.final["usage"]), dict(b.final["usage"])):
            assert usage.pop("device_us") > 0  # each one's share of the step time
            assert usage == {"prompt_tokens": 5, "completion_tokens": 5}
        # What a resumed or replayed request reads back is the same as what was sent.
        stored = [e async for e in client.replay("t", whole.rid, after_seq=-1)]
        assert stored == a.events

    run(go, redis_url)


def test_a_steps_events_reach_every_requests_stream_in_order(
        thread_worker: StartWorker, redis_url: str, rds: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's events are appended per tenant in calls of at most EVENTS_PER_CALL: with
    a bound of 2, one batch of three tenants' requests spans several calls each."""
    monkeypatch.setattr(q, "EVENTS_PER_CALL", 2)
    spec = echo(max_batch_size=16, max_wait_ms=200)
    thread_worker(spec)
    words = ["héllo wörld", "ünïcode ✓", "abc"]

    async def go(client: InferenceClient) -> None:
        handles = [await client.submit(spec, tenant=f"t{i % 3}",
                                       job=chat(words[i % 3], stream=True))
                   for i in range(9)]
        results = await asyncio.gather(*(collect(h) for h in handles))
        for i, (handle, result) in enumerate(zip(handles, results, strict=True)):
            assert result.text == words[i % 3]
            assert [e["seq"] for e in result.events] == list(range(len(result.events)))
            stored = [e async for e in client.replay(handle.tenant, handle.rid,
                                                     after_seq=-1)]
            assert stored == result.events
            assert 0 < rds.ttl(q.out_key(handle.tenant, handle.rid)) <= q.OUT_TTL_S

    run(go, redis_url)


def test_resume_from_an_offset_gives_the_identical_rest(thread_worker: StartWorker,
                                                        redis_url: str) -> None:
    spec = DeploymentSpec(unique("tiny"), RuntimeName.TINY_CAUSAL_LM, max_batch_size=4)
    thread_worker(spec)

    async def go(client: InferenceClient) -> None:
        handle = await client.submit(spec, tenant="t", job=chat("hello", max_tokens=20),
                                     timeout_s=60)
        full = await collect(handle)
        assert full.final["t"] == "done" and len(full.text) > 0
        cut = 3
        rest = [e async for e in client.replay("t", handle.rid, after_seq=cut - 1)]
        head = "".join(e["text"] for e in full.events[:cut] if e["t"] == "delta")
        assert head + "".join(e.get("text", "") for e in rest) == full.text
        assert rest[-1] == full.final

    run(go, redis_url)


def test_bad_requests_get_typed_errors(thread_worker: StartWorker, redis_url: str) -> None:
    spec = echo(max_context=32)
    thread_worker(spec)

    async def go(client: InferenceClient) -> list[Result]:
        too_long = await client.submit(spec, tenant="t", job=chat("y" * 100))
        malformed = await client.submit(spec, tenant="t", job=ChatJob())
        return [await collect(too_long), await collect(malformed)]

    too_long, malformed = run(go, redis_url)
    assert too_long.final["status"] == 400 and too_long.final["code"] == "context_length_exceeded"
    assert malformed.final["status"] == 400


def test_a_request_the_kv_cache_can_never_hold_is_a_400_and_its_neighbours_run(
        thread_worker: StartWorker, redis_url: str) -> None:
    spec = DeploymentSpec(unique("tiny"), RuntimeName.TINY_CAUSAL_LM, max_batch_size=4,
                          extra={"kv_cache_tokens": 200})
    thread_worker(spec)

    async def go(client: InferenceClient) -> list[Result]:
        handles = [await client.submit(spec, tenant="t", job=chat("hi", max_tokens=n),
                                       timeout_s=60) for n in (250, 4)]
        return [await collect(h) for h in handles]

    huge, fits = run(go, redis_url)
    assert huge.final["t"] == "error" and huge.final["status"] == 400
    assert huge.final["code"] == "kv_cache_too_small" and huge.final.get("retry") is False
    assert fits.final["t"] == "done" and fits.final["usage"]["completion_tokens"] > 0


def test_embeddings_are_batched_per_call(thread_worker: StartWorker, redis_url: str) -> None:
    from inference.weights import MINILM

    spec = DeploymentSpec(unique("minilm"), RuntimeName.ENCODER, weights=MINILM,
                          max_batch_size=8, max_wait_ms=200)

    async def go(client: InferenceClient) -> list[Result]:
        handles = [await client.submit(spec, tenant="t", job=EmbedJob(input=[f"text {i}", "x"]))
                   for i in range(3)]
        worker = thread_worker(spec)
        results = [await collect(h) for h in handles]
        assert len(worker.admitted[0]) == 3, "three calls, one model batch"
        return results

    for result in run(go, redis_url):
        vectors = result.events[0]["data"]
        assert len(vectors) == 2 and len(vectors[0]) == 384
        assert result.final["usage"]["prompt_tokens"] > 0


def test_workers_publish_heartbeats_with_memory(thread_worker: StartWorker,
                                                rds: redis.Redis) -> None:
    spec = echo()
    worker = thread_worker(spec)
    deadline = time.monotonic() + 5
    while worker.id not in heartbeats(rds, spec.name):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    beat = heartbeats(rds, spec.name)[worker.id]
    assert beat["mem_used"] > 10 * 2**20 and beat["mem_total"] >= beat["mem_used"]
    assert beat["max_batch"] == spec.max_batch_size and beat["load"] == 0


def test_gateway_backfills_events_lost_on_its_own_stream(redis_url: str,
                                                         rds: redis.Redis) -> None:
    """A worker writes every event to the request's stream and, batched, to the waiting
    gateway's stream. If a gateway message is lost, the handle fills the gap from the
    request's stream instead of silently dropping text."""
    spec = echo()

    async def go(client: InferenceClient) -> None:
        handle = await client.submit(spec, tenant="t", job=chat("abc"))
        events = [{"t": "delta", "seq": i, "text": ch, "ids": [ord(ch)]}
                  for i, ch in enumerate("abc")]
        events.append({"t": "done", "seq": 3, "finish": "stop",
                       "usage": {"prompt_tokens": 3, "completion_tokens": 3}})
        for event in events:  # as a worker would write them
            rds.xadd(q.out_key("t", handle.rid), {"e": encode_event(event)})
        for event in (events[0], events[3]):  # ...but "b" and "c" never reach the gateway
            rds.xadd(q.gateway_key(client.gateway_id),
                     {"b": f'[["{handle.rid}",{encode_event(event)}]]'})
        result = await collect(handle)
        assert result.text == "abc"
        assert [e["seq"] for e in result.events] == [0, 1, 2, 3]

    run(go, redis_url)


def test_the_router_trims_what_it_read_from_its_stream_at_most_every_interval(
        redis_url: str, rds: redis.Redis) -> None:
    """The router deletes the entries it has routed from the gateway's stream (and keeps
    an expiry on it, so it vanishes with a dead gateway), but not after every read: at
    most every `_TRIM_EVERY_S`."""
    from inference import client as client_module

    spec = echo()

    async def go(client: InferenceClient) -> None:
        key = q.gateway_key(client.gateway_id)

        async def routed(text: str) -> None:
            handle = await client.submit(spec, tenant="t", job=chat(text))
            done = {"t": "done", "seq": 0, "finish": "stop",
                    "usage": {"prompt_tokens": 1, "completion_tokens": 0}}
            rds.xadd(key, {"b": f'[["{handle.rid}",{encode_event(done)}]]'})
            assert (await collect(handle)).final["finish"] == "stop"

        # The trim removes every entry read, the last one too (it may hold reply text).
        await routed("first")
        await asyncio.sleep(0.05)
        assert rds.xlen(key) == 0 and 0 < rds.ttl(key) <= q.OUT_TTL_S  # read, trimmed
        await routed("second")  # within the interval: routed, not trimmed yet
        await asyncio.sleep(0.05)
        assert rds.xlen(key) == 1
        # After the interval, the router's next wake-up (a read, or an idle block's
        # end) trims it, with no further traffic.
        deadline = time.monotonic() + client_module._ROUTER_BLOCK_MS / 1000 + 5
        while rds.xlen(key) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert rds.xlen(key) == 0

    run(go, redis_url)


def test_emptied_streams_stay_watched_then_are_forgotten(thread_worker: StartWorker,
                                                         redis_url: str,
                                                         rds: redis.Redis) -> None:
    spec = echo()
    thread_worker(spec)
    suffix = q.stream_suffix("t", 0)

    async def once(client: InferenceClient) -> str:
        return (await collect(await client.submit(spec, tenant="t", job=chat("hi")))).text

    assert run(once, redis_url) == "hi"
    # Empty but kept: idle workers block on it, so the next request wakes them at once.
    assert rds.hget(q.streams_key(spec.name), suffix) == b"0"
    assert rds.exists(q.stream_key(spec.name, suffix))
    # Another worker's intake, as its cleanup period comes round (every _CLEANUP_S).
    intake = Intake(spec, rds, "cleaner", reclaim_after_ms=30_000, stopping=threading.Event())
    intake.forget_empty_streams()  # first pass: noticed idle
    assert rds.exists(q.stream_key(spec.name, suffix))
    intake.forget_empty_streams()  # still idle a period later: forgotten
    assert not rds.exists(q.stream_key(spec.name, suffix))
    assert not rds.hexists(q.streams_key(spec.name), suffix)
    assert run(once, redis_url) == "hi", "a new request recreates the stream"


def test_a_requests_final_events_are_written_once_and_a_later_claim_gets_the_stored_final(
        rds: redis.Redis) -> None:
    """FINALS_LUA, per request of one call: the first claim appends the request's events
    and owns its final; a later claim (a redelivery to another worker) appends nothing
    and gets the final that was stored; a request with no final stored gets 0."""
    tenant = unique("t")
    rids = [unique("r") for _ in range(3)]
    keys = [k for rid in rids for k in (q.done_key(tenant, rid), q.out_key(tenant, rid))]
    delta = encode_event({"t": "delta", "seq": 0, "text": "hé"})
    done = encode_event({"t": "done", "seq": 1, "finish": "stop"})
    first = rds.eval(q.FINALS_LUA, len(keys[:4]), *keys[:4], "w1", q.OUT_TTL_S,
                     2, delta, done, 1, done)
    assert first == [1, 1]
    rds.set(q.done_key(tenant, rids[2]), "w0")  # claimed, its final never written
    again = rds.eval(q.FINALS_LUA, len(keys), *keys, "w2", q.OUT_TTL_S,
                     1, done, 1, done, 1, done)
    assert again == [done.encode(), done.encode(), 0]
    assert [e[b"e"].decode() for _id, e in rds.xrange(q.out_key(tenant, rids[0]))] == \
        [delta, done]
    assert rds.xlen(q.out_key(tenant, rids[1])) == 1
    assert not rds.exists(q.out_key(tenant, rids[2]))
    assert 0 < rds.ttl(q.out_key(tenant, rids[0])) <= q.OUT_TTL_S


@RELAYED
def test_a_first_deliverys_final_goes_out_in_one_round_trip_a_redeliverys_asks_first(
        redis_url: str, rds: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    """A worker writing the final of a first delivery claims it in the same round trip
    as the gateway's message and the ack (no other worker can have finished it unless
    it took it over from a stalled worker); a redelivery asks first and tells the
    gateway the final that stands. In the stall case the gateway gets both finals (it
    keeps the first) while the request's stream keeps the owner's, and it is logged."""
    spec, tenant, gateway = echo(), unique("t"), unique("gw")
    url = urlsplit(redis_url)

    def request(rid: str) -> q.QueuedRequest:
        return q.QueuedRequest(rid=rid, tenant=tenant, kind="chat", body=b"{}", gateway=gateway,
                               deadline_ms=q.now_ms() + 60_000)

    def events(text: str) -> list[Event]:
        return [{"t": "delta", "seq": 0, "text": text, "ids": [1]},
                {"t": "done", "seq": 1, "finish": "stop",
                 "usage": {"prompt_tokens": 1, "completion_tokens": 1}}]

    def gateway_items() -> list[tuple[str, dict[str, Any]]]:
        return [(rid, event) for _id, fields in rds.xrange(q.gateway_key(gateway))
                for rid, event in json.loads(fields[b"b"])]

    def stored(rid: str) -> list[str]:
        return [json.loads(f[b"e"])["text"] for _id, f in rds.xrange(q.out_key(tenant, rid))
                if json.loads(f[b"e"])["t"] == "delta"]

    async def scenario() -> list[int]:
        relay = ReplyCutter(url.hostname or "127.0.0.1", url.port or 6379)
        port = await relay.start()
        writer = Writer(redis.Redis(host="127.0.0.1", port=port, db=int(url.path[1:] or 0)),
                        spec.name, unique("w"))
        writes = []
        try:
            await asyncio.to_thread(writer.redis.ping)  # connected, the handshake done
            for script in (q.FINALS_LUA, q.EVENTS_LUA, q.ACKS_LUA):
                rds.script_load(script)  # known to Redis: no EVAL fallback round trip
            for rid, deliveries in (("fresh", 1), ("stalled", 1), ("redelivered", 2)):
                req = request(rid)
                if rid != "fresh":  # another worker finished it first
                    keys = [q.done_key(tenant, rid), q.out_key(tenant, rid)]
                    rds.eval(q.FINALS_LUA, 2, *keys, "w0", q.OUT_TTL_S, 2,
                             *(encode_event(e) for e in events("owner's")))
                before = relay.writes
                await asyncio.to_thread(writer.write, [(req, e) for e in events("mine")],
                                        [Pending(f"{tenant}:0", "1-1", req, deliveries)])
                writes.append(relay.writes - before)
        finally:
            writer.close(wait=True)
            writer.redis.close()
            await relay.close()
        return writes

    with caplog.at_level("WARNING", logger="sluice.worker"):
        writes = asyncio.run(scenario())
    assert writes == [1, 1, 2], "round trips: first deliveries 1, a redelivery 2"
    items = gateway_items()
    texts = {rid: [e.get("text") for r, e in items if r == rid] for rid in
             ("fresh", "stalled", "redelivered")}
    assert texts["fresh"] == ["mine", None]
    assert texts["stalled"] == ["mine", None], "presumed owner: its events went out"
    assert texts["redelivered"] == [None], "only the stored final, none of its own events"
    assert [e["t"] for r, e in items if r == "redelivered"] == ["done"]
    assert stored("fresh") == ["mine"]
    assert stored("stalled") == stored("redelivered") == ["owner's"]
    assert any("stalled" in r.getMessage() for r in caplog.records)


class _TimedEcho(EchoRuntime):
    """The echo runtime, recording each step's thread and span, with a detokenization
    that costs the worker's thread ~`decode_ms` (a sleep, so it needs no core)."""

    def __init__(self, *, decode_ms: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.decode_s = decode_ms / 1000
        self.steps: list[tuple[str, float, float]] = []

    def step(self) -> dict[str, int]:
        began = time.monotonic()
        tokens = super().step()
        self.steps.append((threading.current_thread().name, began, time.monotonic()))
        return tokens

    def decode(self, ids: Sequence[int]) -> str:
        time.sleep(self.decode_s)
        return super().decode(ids)


@pytest.mark.parametrize("delay_ms", [40, 0])
def test_long_steps_overlap_the_workers_own_work_and_change_no_answer(
        thread_worker: StartWorker, redis_url: str, delay_ms: int) -> None:
    """With steps of 40 ms and up to ~32 ms of the worker's own work per step (token
    handling), the next step runs on the model thread meanwhile: the batch keeps the
    model's pace, not the model's plus the worker's. Without a delay, steps stay on the
    worker's thread. Either way each request gets exactly its answer: lengths, stop
    strings, cancellation, and the sequences that finished during a step leave the
    runtime."""
    spec = echo(max_batch_size=8, max_wait_ms=100, echo_token_delay_ms=delay_ms)
    runtime = _TimedEcho(decode_ms=4 if delay_ms else 0, token_delay_ms=delay_ms)
    worker = thread_worker(spec, runtime=runtime)

    async def go(client: InferenceClient) -> None:
        plain = await client.submit(spec, tenant="t", job=chat("abcdefghijkl"))
        short = await client.submit(spec, tenant="t", job=chat("abcdefghijkl", max_tokens=5))
        stop = await client.submit(spec, tenant="t", job=chat("abcdefXYghijkl", stop=["XY"]))
        cancel = await client.submit(spec, tenant="t", job=chat("z" * 200, max_tokens=500))
        results = await asyncio.gather(collect(plain), collect(short), collect(stop))
        await cancel.cancel()
        cancelled = await collect(cancel)
        assert [(r.text, r.final["finish"], r.final["usage"]["completion_tokens"])
                for r in results] == [("abcdefghijkl", "stop", 12), ("abcde", "length", 5),
                                      ("abcdef", "stop", 8)]
        assert cancelled.final["finish"] == "cancelled"
        assert len(cancelled.text) == cancelled.final["usage"]["completion_tokens"] < 200

    run(go, redis_url)
    deadline = time.monotonic() + 5
    while runtime.active or worker.active:
        assert time.monotonic() < deadline, "finished sequences stayed in the runtime"
        time.sleep(0.02)
    threads = [name for name, _, _ in runtime.steps]
    if not delay_ms:
        assert not any(name.startswith("sluice-model") for name in threads)
        return
    # The first step runs inline: it tells how long steps are.
    assert threads[0] != "sluice-model_0" and set(threads[1:]) == {"sluice-model_0"}, threads
    # The batch's pace: from the first step's start to the last one's end, against the
    # steps' own time (measured 1.07x; with the worker's work in series, 1.55x).
    spans = sorted((began, ended) for _, began, ended in runtime.steps)
    busy = sum(ended - began for began, ended in spans)
    assert spans[-1][1] - spans[0][0] < 1.35 * busy, (spans[-1][1] - spans[0][0], busy)


def test_a_newcomers_first_token_goes_out_behind_the_running_batchs(
        thread_worker: StartWorker, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that joins a batch whose steps overlap gets its first token (its
    prefill's) in the same gateway message as the batch's step, behind the batch's
    tokens: from then on its place in every message is the same (newcomers last), so a
    wave's fan-out does not move it from the front to the back between two tokens."""
    spec = echo(max_batch_size=8, max_wait_ms=10, echo_token_delay_ms=30)
    thread_worker(spec)
    messages: list[list[str]] = []  # the request ids of each gateway message, in order
    add = q.add_gateway_message

    def spy(client: Any, gateway: str, items: list[str]) -> None:
        messages.append([json.loads(item)[0] for item in items])
        add(client, gateway, items)

    monkeypatch.setattr(q, "add_gateway_message", spy)

    async def go(client: InferenceClient) -> tuple[str, str, list[Result]]:
        running = await client.submit(spec, tenant="t", job=chat("r" * 40))
        batch = asyncio.create_task(collect(running))  # 40 steps of 30 ms
        await asyncio.sleep(0.15)  # a few steps in: they overlap by now
        newcomer = await client.submit(spec, tenant="t", job=chat("nnnnnn"))
        results = await asyncio.gather(batch, collect(newcomer))
        return running.rid, newcomer.rid, list(results)

    old, new, results = run(go, redis_url)
    assert [(r.text, r.final["finish"]) for r in results] == [("r" * 40, "stop"),
                                                             ("nnnnnn", "stop")]
    shared = [m for m in messages if old in m and new in m]
    assert shared, messages
    # Its first token shares a message with the batch's step, and every message that
    # holds both has the batch's event first.
    assert all(m.index(old) < m.index(new) for m in shared), shared


def test_tool_call_batches_overlap_and_answer_as_inline_steps_do(
        thread_worker: Callable[..., Worker], redis_url: str) -> None:
    """The sampler advances a call's constraint on the model thread, so an overlapping
    worker may read it one token ahead: the replies (calls, free text, usage) must be
    those of a worker that runs every step inline."""
    tools = [{"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    bodies = [chat(f"weather {i}?", tools=tools, tool_choice="required", max_tokens=60)
              for i in range(4)]
    bodies.append(chat("hello there", tools=tools, tool_choice="auto", max_tokens=12))

    def answers(overlap_min_step_s: float) -> tuple[list[dict[str, Any]], Worker]:
        spec = DeploymentSpec(unique("tiny"), RuntimeName.TINY_CAUSAL_LM, max_batch_size=8)
        worker = thread_worker(spec, block_ms=50, overlap_min_step_s=overlap_min_step_s)

        async def go(client: InferenceClient) -> list[Result]:
            handles = [await client.submit(spec, tenant="t", job=body, timeout_s=60)
                       for body in bodies]
            return list(await asyncio.gather(*[collect(h) for h in handles]))

        results = run(go, redis_url)
        # Step time differs from run to run, and so does the prefix cache's reuse (which
        # requests share a prefill, what an earlier run left cached); the tokens do not.
        for r in results:
            assert r.final["usage"].get("device_us", 0) > 0
        return [{"text": r.text, "finish": r.final.get("finish"),
                 "usage": {k: v for k, v in r.final["usage"].items()
                           if k not in ("device_us", "cached_tokens")},
                 "calls": [(c["name"], c["arguments"]) for c in r.final.get("tool_calls", [])]}
                for r in results], worker

    overlapped, worker = answers(0.0)
    inline, other = answers(1e9)
    assert worker.overlapped > 0 and other.overlapped == 0
    assert overlapped == inline
    assert [a["finish"] for a in inline[:4]] == ["tool_calls"] * 4
    assert all(json.loads(a["calls"][0][1])["city"] for a in inline[:4])
