"""Sluice on a Redis Cluster (issue #32, part 1): a real cluster of 3 masters with a
replica each, started here, and the real pipeline on it in processes of their own (the
run command's HTTP server, echo workers, the audit writer, the autoscaler deciding
only), pointed at it by REDIS_URL=redis+cluster://...; Celery's broker, which cannot use
a cluster, on the test's single Redis (SLUICE_CELERY_REDIS_URL).

Through it: chat completions streamed and not, a rate limit and a quota enforced, a
stream resumed after its connection dropped, a revoked key refused (the caches' epochs),
the audit chain written and verified, the autoscaler's state and the metrics' cluster
rows read. test_redis_cluster_failover.py fails the masters over under load."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from django.conf import settings

from governance import audit
from governance import quota as quotas
from governance.models import (
    AuditEvent,
    BreakerPolicy,
    Quota,
    RateLimitPolicy,
    RateLimitScope,
)
from inference import autoscaler
from inference import queue as q
from inference.models import Deployment
from sluice.localinfra import StartedCluster, start_redis_cluster
from sluice.redis import sync_client
from tenants.roles import Role
from tests.conftest import REPO, Org, eventually, gateway_process, make_org, process_env

pytestmark = pytest.mark.slow

DEADLINE_S = 20  # the gateway's SLUICE_REQUEST_TIMEOUT_S


@pytest.fixture(scope="module")
def cluster() -> Iterator[StartedCluster]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are not installed: no Redis Cluster to run")
    started = start_redis_cluster(masters=3, replicas=1, node_timeout_ms=1000)
    try:
        yield started
    finally:
        started.stop()


@dataclass
class Stack:
    """A gateway, workers and the helpers on the cluster; `rds`: a cluster client."""

    base: str
    env: dict[str, str]
    rds: Any
    log: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def sdk(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0,
                             timeout=DEADLINE_S + 10)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def worker_command(spec: str, redis_url: str) -> list[str]:
    return [sys.executable, "-m", "inference.worker", "--spec", spec, "--redis-url", redis_url,
            "--reclaim-after-ms", "1500"]


@contextlib.contextmanager
def stack_on(cluster: StartedCluster, tmp_path: Path, deployments: dict[Deployment, int],
             *, autoscale: bool = False) -> Iterator[Stack]:
    """The gateway, `deployments`' workers (how many each), the audit writer and (with
    `autoscale`) the autoscaler deciding only, all on `cluster`, which starts empty.
    Policies must be in the database before: the gateway's caches start with them."""
    rds = sync_client(cluster.url, socket_timeout=5, socket_connect_timeout=2)
    rds.flushall()
    env = process_env(REDIS_URL=cluster.url, SLUICE_CELERY_REDIS_URL=settings.REDIS_URL,
                      SLUICE_REQUEST_TIMEOUT_S=str(DEADLINE_S), SLUICE_STATE_DIR=str(tmp_path),
                      SLUICE_LOG_LEVEL="WARNING")
    log = tmp_path / "processes.log"
    out = log.open("ab")
    procs: list[subprocess.Popen[bytes]] = []

    def start(command: list[str]) -> None:
        procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=out))

    try:
        for deployment, count in deployments.items():
            for _ in range(count):
                start(worker_command(deployment.to_spec().to_json(), cluster.url))
        start([sys.executable, "manage.py", "auditwriter"])
        if autoscale:
            start([sys.executable, "manage.py", "autoscale", "--driver", "none"])
        with gateway_process(env, output=out) as (_gateway, base):
            stack = Stack(base, env, rds, log, procs)
            for deployment, count in deployments.items():
                eventually(lambda d=deployment, n=count: len(q.live_heartbeats(
                    rds.hgetall(q.workers_key(d.name)))) >= n, 90,
                    what=f"{deployment.name}'s workers")
            yield stack
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        out.close()
        rds.close()


def _text(body: str) -> str:
    out = ""
    for line in body.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                out += chunk["choices"][0]["delta"].get("content") or ""
    return out


def _finals(rds: Any, tenant: str, rid: str) -> int:
    return sum(1 for _id, f in rds.xrange(q.out_key(tenant, rid))
               if b'"t":"done"' in f[b"e"] or b'"t":"error"' in f[b"e"])


def test_the_pipeline_on_a_redis_cluster(transactional_db: None, cluster: StartedCluster,
                                         tmp_path: Path) -> None:
    alice = make_org("alice", [Role.TENANT_ADMIN, Role.DEVELOPER])
    limited = make_org("limited", [Role.DEVELOPER])
    metered = make_org("metered", [Role.DEVELOPER])
    ops = make_org("ops", [Role.PLATFORM_ADMIN])
    RateLimitPolicy.objects.create(tenant=limited.tenant, scope=RateLimitScope.TENANT,
                                   requests_per_minute=1, burst_requests=2)
    quota = Quota.objects.create(tenant=metered.tenant, max_requests=3)
    echo = Deployment.objects.create(name="echo", runtime="echo", max_batch_size=8,
                                     echo_token_delay_ms=2)
    # A breaker and load shedding on echo: every call is admitted through them.
    BreakerPolicy.objects.create(deployment=echo, shed_queue_depth=1000)
    slow = Deployment.objects.create(name="slow-echo", runtime="echo", max_batch_size=8,
                                     echo_token_delay_ms=40)
    with stack_on(cluster, tmp_path, {echo: 1, slow: 1}, autoscale=True) as stack:
        try:
            _calls_streamed_and_not(stack, alice)
            _rate_limit_and_quota(stack, limited, metered, quota)
            _resumed_stream(stack, alice)
            _revoked_key_refused(stack, alice)
            _live_state_and_metrics(stack, ops)
            _audit_chain(stack, alice)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- processes' log ---\n{stack.log_tail()}") from exc


def _calls_streamed_and_not(stack: Stack, org: Org) -> None:
    sdk = stack.sdk(org.keys[Role.DEVELOPER])
    for i in range(6):  # different tenants' and deployments' slots: every node serves
        text = f"hello {i} from a cluster"
        reply = sdk.chat.completions.create(model="echo",
                                            messages=[{"role": "user", "content": text}])
        assert reply.choices[0].message.content == text
        rid = reply.id.removeprefix("chatcmpl-")
        # The worker's step writes the request's stream and tells the gateway in one
        # pipeline, but on a cluster they are different nodes: the reply may come first.
        eventually(lambda rid=rid: _finals(stack.rds, "alice", rid) == 1, 10,
                   what="the final in the request's stream")
        assert _finals(stack.rds, "alice", rid) == 1, "written once"
        streamed = sdk.chat.completions.create(
            model="echo", stream=True, messages=[{"role": "user", "content": text}])
        assert "".join(c.choices[0].delta.content or "" for c in streamed
                       if c.choices) == text
    # Usage is counted in the tenant's slot (the recorder's flush, once per flush).
    eventually(lambda: sum(int(v) for k, v in stack.rds.hgetall(
        _usage_key("alice")).items() if k.endswith(b"|r")) == 12, 10,
        what="alice's 12 calls counted")


def _usage_key(tenant: str) -> str:
    from datetime import UTC, datetime

    from governance.usage import usage_key
    return usage_key(tenant, datetime.now(UTC).date().isoformat())


def _rate_limit_and_quota(stack: Stack, limited: Org, metered: Org, quota: Quota) -> None:
    hello = [{"role": "user", "content": "hi"}]
    sdk = stack.sdk(limited.keys[Role.DEVELOPER])
    for _ in range(2):  # the burst
        sdk.chat.completions.create(model="echo", messages=hello)
    with pytest.raises(openai.RateLimitError) as refused:
        sdk.chat.completions.create(model="echo", messages=hello)
    assert refused.value.response.headers.get("retry-after")
    assert str((refused.value.body or {}).get("code", "")).startswith("rate_limit")

    sdk = stack.sdk(metered.keys[Role.DEVELOPER])
    for _ in range(3):
        sdk.chat.completions.create(model="echo", messages=hello)
    with pytest.raises(openai.RateLimitError) as over:
        sdk.chat.completions.create(model="echo", messages=hello)
    assert "quota" in str((over.value.body or {}).get("code", "")), over.value.body

    def used() -> tuple[int, int]:
        peek = stack.rds.eval(quotas.PEEK_LUA, 3, *quotas.keys_for("metered", [quota]),
                              *quotas.peek_args([quota]))
        return int(peek[0][0]), int(peek[0][2])  # requests, open reservations

    eventually(lambda: used() == (3, 0), 10, what="the quota charged the 3 answered calls")


def _resumed_stream(stack: Stack, org: Org) -> None:
    text = "resume me on a cluster " * 3
    body = {"model": "slow-echo", "stream": True, "messages": [{"role": "user",
                                                                 "content": text}]}
    auth = {"Authorization": f"Bearer {org.keys[Role.DEVELOPER]}"}
    with httpx.Client(base_url=stack.base, timeout=DEADLINE_S + 10) as http:
        lines: list[str] = []
        with http.stream("POST", "/v1/chat/completions", json=body, headers=auth) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                lines.append(line)
                if len([x for x in lines if x.startswith("data: ")]) >= 6:
                    break  # the connection drops mid-stream
        last_id = [x[4:].strip() for x in lines if x.startswith("id:")][-1]
        rest = http.post("/v1/chat/completions", json=body,
                         headers={**auth, "Last-Event-ID": last_id})
    assert rest.status_code == 200, rest.text
    assert rest.text.rstrip().endswith("data: [DONE]")
    assert _text("\n".join(lines)) + _text(rest.text) == text
    rid = last_id.split(":")[0]
    assert _finals(stack.rds, "alice", rid) == 1, "generated once, not again"


def _revoked_key_refused(stack: Stack, org: Org) -> None:
    """A revoked key stops working within seconds: the service bumps the auth cache's
    epoch in the cluster, which the gateway reads."""
    sdk = stack.sdk(org.keys[Role.DEVELOPER])
    hello = [{"role": "user", "content": "hi"}]
    sdk.chat.completions.create(model="echo", messages=hello)  # cached by the gateway now
    admin = {"Authorization": f"Bearer {org.keys[Role.TENANT_ADMIN]}"}
    with httpx.Client(base_url=stack.base, timeout=10) as http:
        assert http.delete(f"/api/v1/keys/{org.key_rows[Role.DEVELOPER].pk}",
                           headers=admin).status_code == 200

    def refused() -> bool:
        try:
            sdk.chat.completions.create(model="echo", messages=hello)
        except openai.AuthenticationError:
            return True
        return False

    eventually(refused, 5, what="the revoked key refused")


def _live_state_and_metrics(stack: Stack, ops: Org) -> None:
    """What operators read comes from the cluster: a breaker's live state through the
    management API, the autoscaler's decisions, and /metrics' cluster-wide rows."""
    with httpx.Client(base_url=stack.base, timeout=10) as http:
        admin = {"Authorization": f"Bearer {ops.keys[Role.PLATFORM_ADMIN]}"}

        def breaker() -> dict[str, Any]:
            reply = http.get("/api/v1/governance/breakers/echo", headers=admin)
            assert reply.status_code == 200, reply.text
            return dict(reply.json()["live"])

        # The calls' outcomes, recorded in the deployment's slot by the gateway.
        def recorded() -> dict[str, Any] | None:
            state = breaker()
            return state if state["calls"] > 0 else None

        live = eventually(recorded, 10, what="the breaker's recorded calls")
        assert live["state"] == "closed" and live["workers"] == 1, live
        eventually(lambda: "echo" in autoscaler.state(stack.rds), 30,
                   what="the autoscaler's decision for echo in the cluster")
        assert autoscaler.state(stack.rds)["echo"]["desired"] >= 1

        def scraped() -> str | None:
            text = http.get("/metrics").text
            return text if 'sluice_workers{deployment="echo"} 1.0' in text else None

        metrics = eventually(scraped, 10, what="the metrics' cluster rows")
    assert 'sluice_autoscaler_desired_replicas{deployment="echo"}' in metrics
    assert 'sluice_quota_used{metric="requests",model="*",period="day",tenant="metered"} 3.0' \
        in metrics, [line for line in metrics.splitlines() if "quota_used" in line]


def _audit_chain(stack: Stack, org: Org) -> None:
    """The audit stream (one key, in one slot) reaches the database through the audit
    writer process, and the chain verifies."""
    eventually(lambda: stack.rds.xlen(audit.STREAM) == 0 and AuditEvent.objects.filter(
        tenant=org.tenant, action="chat.completions").count() >= 12, 20,
        what="the audit writer to drain the stream")
    assert audit.verify() == []


def test_direct_round_trips_go_to_each_slots_node_and_follow_a_failover(
        cluster: StartedCluster) -> None:
    """The hot path's own round trips (sluice/redisdirect.py): the Coalescer batches
    each node's scripts on that node's connections, and after the master of a slot is
    failed over, a script for it and the router's read of a stream in it still get their
    answer (the redirection goes through redis-py's cluster client, which moves the next
    round trips to the new master)."""
    from sluice.redis import async_client
    from sluice.redisdirect import Coalescer, DirectConnection
    from tests.sluice.test_redis_cluster_failover import fail_over, masters_with_replicas

    echo = "return {KEYS[1], ARGV[1]}"
    stream = "sluice:gw:direct-test"

    async def scripts(coalescer: Coalescer, tag: str) -> None:
        keys = [f"sluice:{{t{i}}}:x" for i in range(12)]  # spread over every master
        replies = await asyncio.gather(*(coalescer.script(echo, [k], [tag]) for k in keys))
        assert replies == [[k.encode(), tag.encode()] for k in keys]

    async def go() -> None:
        client = async_client(cluster.url, socket_timeout=5, socket_connect_timeout=2)
        coalescer = Coalescer(client)
        router = DirectConnection(client, key=stream)
        try:
            await scripts(coalescer, "before")
            # One set of connections per master.
            assert len(coalescer.connections) == 3 * Coalescer.IN_FLIGHT
            [added] = await router.run([("XADD", stream, "*", "b", "1")])
            assert not isinstance(added, Exception), added
            # Fail over the master of the stream's slot (a third of the scripts' too).
            owner = client.get_node_from_key(stream).port
            replica = next(r for m, r in masters_with_replicas(cluster) if m == owner)
            await asyncio.to_thread(fail_over, cluster, replica)
            await scripts(coalescer, "after")  # none refused: redirected, not failed
            # The router's next read may meet the redirection (MOVED: the old master is
            # a replica now); the one after it reads from the new master.
            first = await router.run([("XRANGE", stream, "-", "+")])
            after = first if not isinstance(first[0], Exception) else \
                await router.run([("XRANGE", stream, "-", "+")])
            assert isinstance(first[0], list | redis.exceptions.MovedError), first
            assert len(after[0]) == 1, after  # the entry, replicated before the switch
            assert client.get_node_from_key(stream).port == replica
            # A blocked read when its node stops being the master (the router's XREAD):
            # ended by the node, it costs that read only; the next one reads from the
            # new master.
            blocked = asyncio.create_task(router.run(
                [("XREAD", "BLOCK", 10_000, "STREAMS", stream, "$")]))
            def blocked_on_node() -> bool:
                with redis.Redis(port=replica) as node:
                    return int(node.info("clients")["blocked_clients"]) >= 1

            await asyncio.to_thread(eventually, blocked_on_node, 5)
            await asyncio.to_thread(fail_over, cluster, owner)  # back to the old master
            try:
                [ended] = await blocked
                assert "UNBLOCKED" in str(ended), ended
            except redis.RedisError:
                pass
            [entries] = await router.run([("XRANGE", stream, "-", "+")])
            assert len(entries) == 1, entries
            assert client.get_node_from_key(stream).port == owner
        finally:
            await coalescer.aclose()
            await router.aclose()
            await client.aclose()

    asyncio.run(go())


def test_a_burst_beyond_the_connection_bound_waits_instead_of_failing(
        cluster: StartedCluster) -> None:
    """max_connections is per node on a cluster; callers past it wait for a free
    connection, as on a single Redis's blocking pool (redis-py's cluster client would
    fail them with MaxConnectionsError)."""
    from sluice.redis import async_client

    async def go() -> list[Any]:
        client = async_client(cluster.url, max_connections=2, socket_timeout=10,
                              socket_connect_timeout=2)
        try:
            return list(await asyncio.gather(
                *(client.incr("sluice:{burst}:n") for _ in range(300)),
                return_exceptions=True))
        finally:
            await client.aclose()

    replies = asyncio.run(go())
    assert sorted(replies) == list(range(1, 301)), [r for r in replies if isinstance(
        r, Exception)][:3]
