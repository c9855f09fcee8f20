"""The upstream worker on the real queue against a real OpenAI-compatible server: the live
Sluice of tests/streaming/conftest.py (uvicorn on a loopback port, echo and tiny model
workers on the test Redis) is the upstream. Requests are queued with the gateway's own
client (inference/client.py) on an `openai_upstream` deployment; the worker runs in a
thread, or as `python -m inference.worker` where a test kills it or the autoscaler
starts it."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis
from django.conf import settings

from inference import queue as q
from inference.client import InferenceClient
from inference.jobs import ChatJob, EmbedJob
from inference.models import Deployment
from inference.spec import DeploymentSpec, Dialect, RuntimeName, UpstreamSpec
from inference.upstream.secrets import seal
from inference.upstream.worker import UpstreamWorker
from inference.worker import heartbeats
from sluice.redis import sync_client
from tenants.roles import Role
from tests.conftest import REPO, Org, eventually, make_org, process_env
from tests.inference.conftest import ProcessWorkers, Result, collect, run
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("alice", [Role.DEVELOPER])


def upstream_spec(live: Live, org: Org, model: str, *, name: str = "up",
                  concurrency: int = 8, dialect: Dialect = Dialect.SLUICE,
                  max_deliveries: int = 3) -> DeploymentSpec:
    return DeploymentSpec(name=name, runtime=RuntimeName.OPENAI_UPSTREAM, max_context=2048,
                          max_deliveries=max_deliveries, upstream=UpstreamSpec(
                              base_url=live.base_url, model=model, dialect=dialect,
                              secret_sealed=seal(org.keys[Role.DEVELOPER]),
                              concurrency=concurrency, read_timeout_s=30.0))


@pytest.fixture
def upstream_worker() -> Iterator[Callable[..., UpstreamWorker]]:
    started: list[tuple[UpstreamWorker, threading.Thread]] = []

    def start(spec: DeploymentSpec, **kwargs: Any) -> UpstreamWorker:
        worker = UpstreamWorker(spec, sync_client(settings.REDIS_URL),
                                private_ok=True, block_ms=200, **kwargs)
        thread = threading.Thread(target=worker.run, kwargs={"drain_s": 2}, daemon=True)
        thread.start()
        started.append((worker, thread))
        return worker

    yield start
    for worker, thread in started:
        worker.stopping.set()
        thread.join(15)


def _user(text: str, **params: Any) -> ChatJob:
    return ChatJob(messages=[{"role": "user", "content": text}], **params)


def test_a_queued_request_streams_from_the_upstream(
        live: Live, org: Org, upstream_worker: Callable[..., UpstreamWorker]) -> None:
    spec = upstream_spec(live, org, "echo", concurrency=5)
    upstream_worker(spec)

    async def go(client: InferenceClient) -> Result:
        handle = await client.submit(spec, tenant="alice", job=_user("Hello there, upstream!"))
        return await collect(handle)

    result = run(go, settings.REDIS_URL)
    assert result.text == "Hello there, upstream!"
    assert [e["seq"] for e in result.events] == list(range(len(result.events)))
    assert len(result.events) > 3  # token by token, as the upstream streamed it
    size = len("Hello there, upstream!")
    assert result.final["t"] == "done" and result.final["finish"] == "stop"
    assert result.final["usage"] == {"prompt_tokens": size, "completion_tokens": size}
    # The heartbeat reports the upstream's concurrency as the batch it may run.
    [beat] = heartbeats(sync_client(settings.REDIS_URL), "up").values()
    assert beat["max_batch"] == 5 and beat["kind"] == "chat"


def test_calls_in_flight_stay_within_the_concurrency_and_tenants_share_them(
        live: Live, org: Org, upstream_worker: Callable[..., UpstreamWorker]) -> None:
    spec = upstream_spec(live, org, "slow-echo", concurrency=2)
    upstream = live.workers["slow-echo"]
    seen: list[int] = []

    async def go(client: InferenceClient) -> tuple[list[str], list[str], list[Result]]:
        # Queued before the worker starts: a flood of one tenant, then another's one.
        handles = [await client.submit(spec, tenant="flood", job=_user(f"flood {i}"))
                   for i in range(5)]
        handles.append(await client.submit(spec, tenant="single", job=_user("single")))
        worker = upstream_worker(spec)

        async def watch() -> None:
            while True:
                seen.append(len(upstream.active))
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        try:
            results = await asyncio.gather(*(collect(h) for h in handles))
        finally:
            watcher.cancel()
        admitted = [rid for batch in worker.admitted for rid in batch]
        return [h.rid for h in handles], admitted, list(results)

    rids, admitted, results = run(go, settings.REDIS_URL)
    assert [r.text for r in results] == [f"flood {i}" for i in range(5)] + ["single"]
    assert sorted(admitted) == sorted(rids)
    assert max(seen) == 2, "two calls at a time on the upstream, and two were reached"
    # The other tenant's lone request is among the first two admitted, not the sixth.
    assert rids[-1] in admitted[:2]


def test_a_cancelled_request_closes_its_upstream_call(
        live: Live, org: Org, upstream_worker: Callable[..., UpstreamWorker],
        settings: Any) -> None:
    settings.SLUICE_STREAM_RESUME_GRACE_S = 0.2  # the upstream Sluice's own grace
    spec = upstream_spec(live, org, "slow-echo")
    upstream_worker(spec)
    upstream = live.workers["slow-echo"]

    async def go(client: InferenceClient) -> Result:
        handle = await client.submit(spec, tenant="alice", job=_user("x" * 300))
        events: list[dict[str, Any]] = []
        async for event in handle.events():
            events.append(dict(event))
            if len(events) == 3:
                await handle.cancel()
        return Result("", events)

    result = run(go, settings.REDIS_URL)
    assert result.final["t"] == "done" and result.final["finish"] == "cancelled"
    sent = [e for e in result.events if e["t"] == "delta"]
    assert result.final["seq"] == len(sent) and len(sent) < 100
    # The upstream saw its client go: its own worker cancelled the job.
    eventually(lambda: not upstream.active, 10, what="the upstream's worker to stop")


def test_deadlines_and_malformed_jobs_are_answered(
        live: Live, org: Org, upstream_worker: Callable[..., UpstreamWorker],
        settings: Any) -> None:
    settings.SLUICE_STREAM_RESUME_GRACE_S = 0.2  # the upstream stops soon after the 504
    spec = upstream_spec(live, org, "slow-echo")
    upstream_worker(spec)

    async def go(client: InferenceClient) -> tuple[Result, Result]:
        late = await client.submit(spec, tenant="alice", job=_user("y" * 200), timeout_s=0.6)
        wrong = await client.submit(spec, tenant="alice", job=EmbedJob(input=["x"]))
        return await collect(late), await collect(wrong)

    late, wrong = run(go, settings.REDIS_URL)
    assert late.final["t"] == "error" and late.final["status"] == 504
    assert late.final["code"] == "deadline_exceeded" and late.final["retry"] is False
    assert wrong.final["t"] == "error" and wrong.final["status"] == 400


def killed_mid_reply(process_workers: ProcessWorkers, first: subprocess.Popen[Any],
                     spec: DeploymentSpec, job: ChatJob, *, next_seq: int = 0,
                     ) -> Callable[[InferenceClient], Awaitable[Result]]:
    """A call (for `run`) that submits `job`, SIGKILLs the `first` worker serving it
    after 8 events (its entry unacknowledged) and starts another, which takes it over;
    its result is every event received."""
    async def go(client: InferenceClient) -> Result:
        handle = await client.submit(spec, tenant="alice", job=job)
        handle.next_seq = next_seq  # as the gateway's continuation does
        events: list[dict[str, Any]] = []
        async for event in handle.events():
            events.append(dict(event))
            if len(events) == 8:
                first.send_signal(signal.SIGKILL)
                first.wait()
                process_workers.start(spec)  # takes the entry over after reclaim
        return Result("".join(e.get("text", "") for e in events if e["t"] == "delta"),
                      events)
    return go


def test_a_takeover_resumes_the_upstream_call_after_what_was_streamed(
        live: Live, org: Org, process_workers: ProcessWorkers,
        monkeypatch: pytest.MonkeyPatch, rds: redis.Redis) -> None:
    monkeypatch.setenv("SLUICE_UPSTREAM_ALLOW_PRIVATE", "true")
    spec = upstream_spec(live, org, "slow-echo")
    prompt = "The quick brown fox jumps over the lazy dog."
    first = process_workers.start(spec)  # python -m inference.worker: the dispatch
    process_workers.wait_live(rds, "up", 1)

    result = run(killed_mid_reply(process_workers, first, spec,
                                  ChatJob(prompt=prompt, max_tokens=500)), settings.REDIS_URL)
    assert result.final["t"] == "done", result.final
    assert [e["seq"] for e in result.events] == list(range(len(result.events)))
    # What the first delivery streamed (S, the prompt's start) is kept; the takeover
    # sent the prompt plus S as a continuation, which the echo model answers whole:
    # the reply is S + prompt + S, each character once, in order.
    size, odd = divmod(len(result.text) - len(prompt), 2)
    streamed = result.text[:size]
    assert not odd and size >= 8 and prompt.startswith(streamed)
    assert result.text == streamed + prompt + streamed
    # Billed once: S as the first delivery's tokens, then the upstream's own count.
    assert result.final["usage"]["completion_tokens"] == len(result.text)


def test_the_autoscaler_starts_upstream_workers(live: Live, org: Org,
                                                rds: redis.Redis) -> None:
    Deployment.objects.create(
        name="up", runtime="openai_upstream", upstream_url=live.base_url,
        upstream_model="echo", upstream_dialect="sluice", min_replicas=1, max_replicas=1,
        upstream_secret=seal(org.keys[Role.DEVELOPER]))
    env = process_env(SLUICE_LOG_LEVEL="WARNING", SLUICE_UPSTREAM_ALLOW_PRIVATE="true")
    proc = subprocess.Popen([sys.executable, str(REPO / "manage.py"), "autoscale",
                             "--deployment", "up", "--tick", "0.2"], cwd=REPO, env=env)
    try:
        beats = eventually(lambda: heartbeats(rds, "up"), 120, what="an upstream worker")
        assert all(int(b["pid"]) != proc.pid for b in beats.values())  # its child
        spec = Deployment.objects.get(name="up").to_spec()

        async def go(client: InferenceClient) -> Result:
            return await collect(await client.submit(spec, tenant="alice",
                                                     job=_user("scaled upstream")))

        assert run(go, settings.REDIS_URL).text == "scaled upstream"
    finally:
        proc.terminate()
        proc.wait(30)
    eventually(lambda: not heartbeats(rds, "up", max_age_s=2.0), 15,
               what="the upstream worker to stop with the autoscaler")


def died_after(rds: redis.Redis, rid: str, event: str) -> None:
    """Alice's one queued request `rid` on "up" as a delivery left it that died after
    writing `event` (encoded) to its stream: read by a dead worker, never acknowledged."""
    suffix = q.stream_suffix("alice", 0)
    rds.xreadgroup(q.GROUP, "dead-worker", {q.stream_key("up", suffix): ">"}, count=1)
    rds.xadd(q.out_key("alice", rid), {"e": event})


def test_a_request_an_earlier_delivery_finished_is_only_acknowledged(
        live: Live, org: Org, upstream_worker: Callable[..., UpstreamWorker],
        rds: redis.Redis) -> None:
    """A redelivery after the final was written (a worker that died between writing the
    final and acknowledging): the worker re-sends that final, calls nobody."""
    spec = upstream_spec(live, org, "echo")

    async def go(client: InferenceClient) -> Result:
        handle = await client.submit(spec, tenant="alice", job=_user("once"))
        died_after(rds, handle.rid, '{"t":"done","seq":0,"finish":"stop",'
                   '"usage":{"prompt_tokens":1,"completion_tokens":0}}')
        worker = upstream_worker(spec, reclaim_after_ms=300)
        result = await collect(handle)
        assert handle.rid in [rid for batch in worker.admitted for rid in batch]
        return result

    result = run(go, settings.REDIS_URL)
    assert result.text == "" and result.final["usage"] == {"prompt_tokens": 1,
                                                          "completion_tokens": 0}
    assert not live.workers["echo"].admitted, "the upstream was called"
    eventually(lambda: not rds.xpending(q.stream_key("up", q.stream_suffix("alice", 0)),
                                         q.GROUP)["pending"], 5, what="the acknowledgement")


def test_a_takeover_after_a_tool_calls_pieces_fails_retriably_without_a_call(
        live: Live, org: Org, upstream_worker: Callable[..., UpstreamWorker],
        rds: redis.Redis) -> None:
    """A redelivery after the earlier delivery streamed a tool call's first pieces: no
    upstream can go on with a call half written, so the request ends in a retriable
    502 after those events, and the upstream is not called."""
    spec = upstream_spec(live, org, "echo")

    async def go(client: InferenceClient) -> Result:
        handle = await client.submit(spec, tenant="alice", job=_user("weather?"))
        died_after(rds, handle.rid, '{"t":"delta","seq":0,"text":"","ids":[],"tools":'
                   '[{"index":0,"id":"call_1","name":"get_weather","arguments":""}]}')
        upstream_worker(spec, reclaim_after_ms=300)
        return await collect(handle)

    result = run(go, settings.REDIS_URL)
    final = result.final
    assert final["t"] == "error" and final["seq"] == 1, final
    assert (final["status"], final["code"], final.get("retry", True)) == (
        502, "upstream_cannot_resume", True)
    assert not live.workers["echo"].admitted, "the upstream was called"
