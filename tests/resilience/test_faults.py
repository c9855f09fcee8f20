"""Faults under load, end to end: 1,000 chat completions through a real gateway process
(the run command's ASGI server, the OpenAI SDK as client) while model workers are killed
with SIGKILL at random and Redis itself is killed and restarted once.

Every call must end within its deadline with either the full, exact reply or a clear,
retriable error (429/503/504 with an OpenAI error body); no reply may be duplicated or
cut; every answered request has exactly one final event; the tenant's quota is charged
exactly the usage of the answered calls, once each.

Redis runs with its append-only file fsynced on every write (`appendfsync always`), as a
production Redis behind a queue should: a restart then loses nothing it acknowledged.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from governance import quota as quotas
from governance.models import Quota
from inference import queue as q
from inference.models import Deployment
from sluice.localinfra import free_port, redis_binary, redis_reachable
from tenants.roles import Role
from tests.conftest import REPO, eventually, gateway_process, make_org, process_env

pytestmark = pytest.mark.slow

CALLS = 1_000
AFTER_CALLS = 50  # once the chaos is over
CONCURRENCY = 48
WORKERS = 3
DEADLINE_S = 20  # the gateway's SLUICE_REQUEST_TIMEOUT_S
RETRIABLE = {429, 503, 504}


class DurableRedis:
    """A private redis-server whose data survives a kill -9 (AOF, fsync always)."""

    def __init__(self) -> None:
        binary = redis_binary()
        if binary is None:
            pytest.skip("no redis-server binary")
        self.binary = binary
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="sluice-durable-redis-")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--loglevel", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        eventually(lambda: redis_reachable(self.url), 10, what="redis-server to start")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Chaos:
    """Kills a random worker every 0.2-0.6 s and starts a replacement (as a supervisor
    would; a worker takes about a second to start here), up to `max_kills`; kills and
    restarts Redis once, `redis_at_s` after it starts. The pace fits a fast machine,
    where the 1,000 calls take ~4 s: the kills must happen while they run."""

    spawn: Any
    redis: DurableRedis
    redis_at_s: float
    max_kills: int = 12
    rng: random.Random = field(default_factory=lambda: random.Random(11))
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    kills: int = 0
    redis_down: tuple[float, float] | None = None  # (killed, answering again), monotonic
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        began = time.monotonic()
        while not self.stop.wait(self.rng.uniform(0.2, 0.6)):
            if self.kills >= self.max_kills:
                continue
            victim = self.rng.choice(self.workers)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            self.kills += 1
            self.workers[self.workers.index(victim)] = self.spawn()
            if self.redis_down is None and time.monotonic() - began > self.redis_at_s:
                down = time.monotonic()
                self.redis.kill()
                time.sleep(1.0)  # down for a second: calls arriving now are refused
                self.redis.start()
                self.redis_down = (down, time.monotonic())


@dataclass
class Outcome:
    index: int
    elapsed_s: float
    ended: float  # monotonic
    text: str | None = None
    rid: str | None = None
    tokens: int = 0
    completion_tokens: int = 0
    status: int | None = None
    code: str | None = None
    retry_after: str | None = None


def prompt(i: int) -> str:
    return f"call {i:04d} " + "abcdefghij" * 2


@pytest.fixture
def durable_redis() -> Iterator[DurableRedis]:
    server = DurableRedis()
    yield server
    server.stop()


def test_sigkilled_workers_and_a_redis_restart_lose_and_double_nothing(
        transactional_db: None, durable_redis: DurableRedis, tmp_path: Any) -> None:
    org = make_org("chaos", [Role.DEVELOPER])
    deployment = Deployment.objects.create(
        name="echo-chaos", runtime="echo", max_batch_size=16, echo_token_delay_ms=3,
        max_queue_depth=4096, tenant_queue_share=1.0, max_deliveries=20)
    quota = Quota.objects.create(tenant=org.tenant, max_tokens=10**12)
    env = process_env(REDIS_URL=durable_redis.url, SLUICE_REQUEST_TIMEOUT_S=str(DEADLINE_S),
                      SLUICE_STATE_DIR=str(tmp_path), SLUICE_LOG_LEVEL="WARNING")
    # SLUICE_CHAOS_LOG=<file> keeps the gateway's and the workers' logs, for a failure.
    logs = Path(os.environ.get("SLUICE_CHAOS_LOG", os.devnull)).open("ab")  # noqa: SIM115
    spec = deployment.to_spec().to_json()

    def spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "inference.worker", "--spec", spec, "--redis-url",
             durable_redis.url, "--reclaim-after-ms", "1500"], cwd=REPO, env=env,
            stdout=logs, stderr=logs)

    with gateway_process(env, output=logs) as (_gateway, base):
        chaos = Chaos(spawn=spawn, redis=durable_redis, redis_at_s=1.5)
        chaos.workers = [spawn() for _ in range(WORKERS)]
        rds = redis.Redis.from_url(durable_redis.url)
        try:
            eventually(lambda: len(q.live_heartbeats(rds.hgetall(q.workers_key(
                deployment.name)))) >= WORKERS, 60, what="the workers")

            killer = threading.Thread(target=chaos.run, daemon=True)
            killer.start()
            try:
                outcomes = asyncio.run(_calls(f"{base}/v1",
                                              org.keys[Role.DEVELOPER], deployment.name))
            finally:
                chaos.stop.set()
                killer.join(30)
            assert chaos.redis_down is not None and chaos.kills >= 5, \
                (chaos.kills, chaos.redis_down)

            # None lost: every call came back, within its deadline (+ the gateway's grace).
            assert sorted(o.index for o in outcomes) == list(range(CALLS))
            slowest = max(o.elapsed_s for o in outcomes)
            assert slowest <= DEADLINE_S + 5, slowest
            answered = [o for o in outcomes if o.text is not None]
            refused = [o for o in outcomes if o.text is None]
            # Errors are clear and retriable, never a 500 or a broken body.
            assert all(o.status in RETRIABLE and o.code for o in refused), \
                sorted({(o.status, o.code) for o in refused})
            assert all(o.retry_after for o in refused if o.status in (429, 503)), \
                "a retriable refusal says when to retry"
            print(f"{len(answered)} answered, {chaos.kills} workers killed, refusals:",
                  Counter((o.status, o.code) for o in refused))
            # Dying workers cost no call; only the Redis outage does (and ends with it): every
            # refusal came while Redis was down or within 3 s of its return. (Refusals up to
            # 7 s later, one run in ten, were stale pooled connections: sluice.redis.
            # reconnecting() and the test below.)
            down, back = chaos.redis_down
            late = [o for o in refused if not down <= o.ended <= back + 3.0]
            assert not late, ([(o.status, o.code, round(o.ended - back, 2)) for o in late],
                              _queue_state(rds, deployment.name))
            # Not vacuous: clients without retries fail fast while Redis is away, so the
            # share refused depends on the machine's pace; but many calls must be answered.
            # (That the service is back after the restart is checked at the end, by calls
            # of their own: how many of these 1,000 are left by then depends on the pace,
            # 8 of them in one suite run.)
            assert len(answered) >= CALLS // 5, len(answered)
            # None cut or doubled: each reply is exactly its prompt, token for token, and
            # each answered request has exactly one final event.
            for o in answered:
                assert o.text == prompt(o.index), (o.index, o.text)
                assert o.completion_tokens == len(prompt(o.index).encode())
            assert len({o.rid for o in answered}) == len(answered)
            for o in answered:
                finals = sum(1 for _id, f in rds.xrange(q.out_key("chaos", o.rid or ""))
                             if b'"t":"done"' in f[b"e"] or b'"t":"error"' in f[b"e"])
                assert finals == 1, (o.rid, finals)
            # No double charge: the quota holds exactly the answered calls' tokens, and no
            # reservation is left open (every admitted call was settled or released).
            expected = sum(o.tokens for o in answered)

            def charged() -> tuple[int, int, int]:
                peek = rds.eval(quotas.PEEK_LUA, 3, *quotas.keys_for("chaos", [quota]),
                                *quotas.peek_args([quota]))
                requests, tokens, open_reservations = peek[0][0], peek[0][1], peek[0][2]
                return int(requests), int(tokens), int(open_reservations)

            eventually(lambda: charged()[2] == 0 and charged()[1] >= expected, 10)
            assert charged() == (len(answered), expected, 0), (charged(), len(answered), expected)
            # Recovered: once the restart and the kills are over, every call is answered.
            after = asyncio.run(_calls(f"{base}/v1", org.keys[Role.DEVELOPER],
                                       deployment.name, count=AFTER_CALLS))
            assert all(o.text == prompt(o.index) for o in after), \
                Counter((o.status, o.code) for o in after if o.text is None)
        finally:
            rds.close()
            chaos.stop.set()
            for proc in chaos.workers:
                proc.kill()
                proc.wait()
            logs.close()


def _queue_state(rds: redis.Redis, name: str) -> dict[str, Any]:
    """What the queue and the gateways' event streams hold (for a failure's message): a
    gateway stream that keeps growing means its router stopped reading."""
    streams = {s.decode(): q.stream_key(name, s.decode()) for s in rds.hkeys(q.streams_key(name))}
    return {"depth": rds.get(q.depth_key(name)),
            "pending": {s: rds.xpending(k, q.GROUP)["pending"] for s, k in streams.items()},
            "gateway_streams": {k.decode(): rds.xlen(k) for k in rds.scan_iter("sluice:gw:*")},
            "dead_lettered": rds.xlen(q.dead_key(name))}


async def _calls(base_url: str, key: str, model: str, count: int = CALLS) -> list[Outcome]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0,
                                timeout=DEADLINE_S + 10)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> Outcome:
        async with gate:
            began = time.monotonic()
            try:
                reply = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt(i)}])
            except openai.APIStatusError as exc:
                error = exc.body if isinstance(exc.body, dict) else {}  # the SDK unwraps it
                return Outcome(i, time.monotonic() - began, time.monotonic(),
                               status=exc.status_code,
                               code=error.get("code"),
                               retry_after=exc.response.headers.get("retry-after"))
            assert reply.usage is not None
            return Outcome(i, time.monotonic() - began, time.monotonic(),
                           text=reply.choices[0].message.content,
                           rid=reply.id.removeprefix("chatcmpl-"),
                           tokens=reply.usage.total_tokens,
                           completion_tokens=reply.usage.completion_tokens)

    try:
        return list(await asyncio.gather(*(one(i) for i in range(count))))
    finally:
        await client.close()


def test_pooled_connections_survive_a_redis_restart(durable_redis: DurableRedis) -> None:
    """Idle pooled connections from before a Redis restart must not fail their next
    command (redis-py 8 skipped its reconnect check while maintenance notifications were
    on: the cause of late 503s after a restart)."""
    from inference.client import InferenceClient

    async def go() -> list[str]:
        client = InferenceClient(durable_redis.url)
        try:
            async def pipeline() -> None:
                pipe = client.redis.pipeline(transaction=False)
                pipe.incr("n")
                pipe.ping()
                await pipe.execute()

            await asyncio.gather(*(pipeline() for _ in range(8)))  # 8 pooled connections
            durable_redis.kill()
            durable_redis.start()
            await asyncio.sleep(0.5)  # every old connection is now closed by the server
            errors = []
            for _ in range(16):  # one after the other: each may take a stale connection
                try:
                    await pipeline()
                    await client.redis.ping()
                except redis.RedisError as exc:
                    errors.append(repr(exc))
            return errors
        finally:
            await client.close()

    assert asyncio.run(go()) == []
