"""Sluice on several nodes, under load, while nodes fail (issue #32, part 2).

Nodes are network namespaces on a private bridge (tests/cluster/netns.py): PostgreSQL
with the audit writer; a Redis Cluster of three masters, each with a replica on another
node, over three nodes (tests/cluster/rediscluster.py); two gateways; two echo model
workers; each on its own node with its own address. Two tenants call through both
gateways with the official SDK, every call with an Idempotency-Key and a deadline,
retried on a connection error or a read timeout against the other gateway with the
same key: "fault" at FAULT_PER_S (a third streamed), and "limited", whose tenant rate
limit it exceeds three times over.
Meanwhile:

    CUT_AT     gateway 1's cable is pulled for CUT_FOR seconds, then plugged back
    WCUT_AT    worker 2's cable is pulled for WCUT_FOR seconds (its requests move)
    KILL_AT    every process of worker 1's node and of gateway 2's node gets SIGKILL;
               both are started again, as a supervisor would
    FAILOVER_AT  the Redis master of the shard holding the tenants' and the model's keys
               gets SIGKILL; its replica is promoted; it comes back as a replica

Each fault on a gateway waits (a few seconds at most) until calls are in flight on it.
After the load, the calls that were not answered are sent again with their keys; then
a few impatient calls give up on their first attempt early and retry elsewhere. The
invariants are checked one test each: every call answered exactly once or refused
retriably within its deadline, and none lost; every answered call charged, none
twice (also those a killed gateway was running, answered to the retry by a replay);
an impatient client's retry gets the whole reply; the rate limit held across the
gateways; the audit chains verify. The figures are printed (run with -s) and recorded
in docs/BENCHMARKS.md; docs/MULTINODE.md says how to run it.

SLUICE_MULTINODE_REDIS=single runs it on one Redis on its own node, without the
failover.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from governance import audit
from governance.models import AuditEvent
from tests.cluster import netns, rediscluster, services
from tests.cluster.load import (
    RETRIABLE,
    Call,
    Clients,
    in_flight_at,
    index_of,
    longest_gap,
    paced,
)
from tests.cluster.load import rate_figures as measure_rate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

FAULT_CALLS, FAULT_PER_S = 416, 8.0  # ~52 s of load
LIMITED_CALLS, LIMITED_PER_S = 156, 3.0  # three times the limit of 1/s
# "cluster": 3 masters + 3 replicas over three nodes, a master failed over under load;
# "single": one Redis on its own node, no failover.
REDIS = os.environ.get("SLUICE_MULTINODE_REDIS", "cluster")
DEADLINE_S = 30.0  # each call's, all its attempts together
# One attempt's read timeout: a cut gateway is given up after this. Well above a call's
# time here (under 1 s; ~3 s when its worker dies), so a healthy gateway's calls never
# time out: the client would leave, and the gateway cancel the call (see IMPATIENT).
ATTEMPT_S = 8.0
REQUEST_TIMEOUT_S = 20  # the gateways' own deadline for a call (SLUICE_REQUEST_TIMEOUT_S)
CUT_AT, CUT_FOR = 6.0, 10.0  # gateway 1's cable; longer than ATTEMPT_S: clients leave it
WCUT_AT, WCUT_FOR = 22.0, 6.0  # worker 2's cable
KILL_AT = 34.0
FAILOVER_AT = 44.0
# The failed-over shard: the fault tenant's keys (idempotency records, events, quota),
# which share their slot range with the model's queue ({echo-mn}) and the limited
# tenant's buckets ({limited}) in the cluster's three-way split.
FAILOVER_TAG = "{fault}"
IMPATIENT, IMPATIENT_S = 4, 0.3  # calls whose first attempt gives up after IMPATIENT_S
PROBE_EVERY_S = 0.5
RECOVERY_LIMIT_S = 60.0  # a gateway that does not serve again within this fails the test
FIRST_PROBE = 50_000  # probe calls' indices start here
FIRST_IMPATIENT = 60_000
BUSY = 3  # a fault on a gateway waits (a few seconds at most) for this many calls on it


@dataclass
class Cluster:
    fabric: netns.Fabric
    platform: services.Platform
    nodes: dict[str, netns.Node]
    bases: list[str]  # gateway 1's and gateway 2's URLs
    seed: dict[str, Any]
    redis: rediscluster.RedisCluster | None  # None: a single Redis


@dataclass
class Run:
    """Everything the invariants look at, gathered before the cluster goes."""

    seed: dict[str, Any]
    calls: list[Call]  # the fault tenant's, probes included
    limited: list[Call]
    resent: list[Call]  # the calls not answered under the faults, sent again
    impatient: list[Call]  # each first sent with a short read timeout, then retried
    marks: dict[str, float]  # when each fault began and ended (monotonic)
    recovery: dict[str, float]
    load_window: tuple[float, float]
    redis: str  # what Redis was, and what failed over
    report: dict[str, Any] = field(default_factory=dict)  # tests/cluster/ops.py report
    figures: dict[str, Any] = field(default_factory=dict)


def _build(fabric: netns.Fabric, logs: services.Logs, pg_data: Path) -> Cluster:
    redis_nodes = ["r1", "r2", "r3"] if REDIS == "cluster" else ["redis"]
    nodes = {name: fabric.node(name) for name in ["pg", *redis_nodes, "gw1", "gw2", "w1", "w2"]}
    database_url = services.start_postgres(nodes["pg"], pg_data, logs)
    cluster = single = None
    if REDIS == "cluster":
        cluster = rediscluster.start_cluster([nodes[n] for n in redis_nodes], logs.folder, logs)
        redis_url = cluster.url
        single = services.start_redis(nodes["r1"], logs.folder, logs)  # Celery's; unused
    else:
        redis_url = services.start_redis(nodes["redis"], logs.folder, logs)
    platform = services.Platform(database_url, redis_url, logs, logs.folder,
                                 REQUEST_TIMEOUT_S, single_redis_url=single)
    seed = platform.ops("seed")
    platform.start_auditwriter(nodes["pg"])
    bases = [platform.start_gateway(nodes["gw1"]), platform.start_gateway(nodes["gw2"])]
    for worker in ("w1", "w2"):
        platform.start_worker(nodes[worker], seed["spec"], seed["model"])
    return Cluster(fabric, platform, nodes, bases, seed, cluster)


class Chaos:
    """The faults, at their times, and the probes that time each recovery."""

    def __init__(self, cluster: Cluster, clients: Clients) -> None:
        self.cluster, self.clients = cluster, clients
        self.marks: dict[str, float] = {}
        self.recovery: dict[str, float] = {}
        self.probes: list[Call] = []
        self.failed_over = self.promoted = ""  # the Redis master killed, its successor

    async def run(self, began: float) -> None:
        fabric, nodes = self.cluster.fabric, self.cluster.nodes
        await self._at(began + CUT_AT)
        await self.clients.busy("fault", 0, BUSY, 5.0)
        fabric.cut(nodes["gw1"])
        self.marks["cut gw1"] = time.monotonic()
        await self._at(began + CUT_AT + CUT_FOR)
        fabric.mend(nodes["gw1"])
        self.marks["mend gw1"] = time.monotonic()
        self.recovery["gateway 1 serves after its cable is back"] = await self._probe(0) - \
            self.marks["mend gw1"]

        await self._at(began + WCUT_AT)
        fabric.cut(nodes["w2"])
        self.marks["cut w2"] = time.monotonic()
        await self._at(began + WCUT_AT + WCUT_FOR)
        fabric.mend(nodes["w2"])
        self.marks["mend w2"] = time.monotonic()

        await self._at(began + KILL_AT)
        await self.clients.busy("fault", 1, BUSY, 5.0)
        killed = nodes["w1"].kill_all() + nodes["gw2"].kill_all()
        self.marks["kill w1+gw2"] = time.monotonic()
        assert killed >= 2, "the kill found no process on the nodes"
        platform, seed = self.cluster.platform, self.cluster.seed
        restarted = asyncio.gather(
            asyncio.to_thread(platform.start_gateway, nodes["gw2"]),
            asyncio.to_thread(platform.start_worker, nodes["w1"], seed["spec"], seed["model"]))
        self.recovery["gateway 2 serves after SIGKILL and restart"] = await self._probe(1) - \
            self.marks["kill w1+gw2"]
        await restarted
        if self.cluster.redis is not None:
            await self._at(began + FAILOVER_AT)
            await self._fail_over(self.cluster.redis)

    async def _fail_over(self, redis_cluster: rediscluster.RedisCluster) -> None:
        """SIGKILL the Redis master of FAILOVER_TAG; time the replica's promotion and the
        first call answered after the kill; start the killed instance again."""
        shard = {redis_cluster.master_of(tag).address
                 for tag in (FAILOVER_TAG, f"{{{self.cluster.seed['model']}}}", "{limited}")}
        assert len(shard) == 1, f"the tags are on several shards: {shard}"
        victim = await asyncio.to_thread(redis_cluster.kill_master, FAILOVER_TAG)
        killed = self.marks["kill redis master"] = time.monotonic()

        async def promotion() -> None:
            self.promoted = await asyncio.to_thread(redis_cluster.promoted, FAILOVER_TAG,
                                                    victim)
            self.marks["replica promoted"] = time.monotonic()

        promoting = asyncio.create_task(promotion())
        answered = await self._probe(0)
        await promoting
        self.failed_over = victim.address
        self.recovery["Redis: replica promoted after its master's SIGKILL"] = \
            self.marks["replica promoted"] - killed
        self.recovery["calls answered again after the Redis master's SIGKILL"] = \
            answered - killed
        await asyncio.to_thread(redis_cluster.restart, victim.address)

    @staticmethod
    async def _at(moment: float) -> None:
        await asyncio.sleep(max(0.0, moment - time.monotonic()))

    async def _probe(self, gateway: int) -> float:
        """Send a call to `gateway` alone every PROBE_EVERY_S until one is answered:
        when it was (monotonic)."""
        began = time.monotonic()
        while time.monotonic() - began < RECOVERY_LIMIT_S:
            probe = Call(FIRST_PROBE + len(self.probes), "fault", stream=False,
                         first=gateway, pinned=True)
            self.probes.append(probe)
            sent = time.monotonic()
            await self.clients.send(probe)
            if probe.outcome == "answered":
                return probe.ended
            await asyncio.sleep(max(0.0, sent + PROBE_EVERY_S - time.monotonic()))
        raise AssertionError(f"gateway {gateway + 1} did not serve again within "
                             f"{RECOVERY_LIMIT_S}s")


async def _load(cluster: Cluster) -> Run:
    """The load under the faults, then the unanswered calls sent again, then the
    impatient calls (the cluster whole again)."""
    keys = cluster.seed["keys"]
    clients = Clients(cluster.bases, keys, cluster.seed["model"], deadline_s=DEADLINE_S,
                      attempt_s=ATTEMPT_S)
    try:
        fault = [Call(i, "fault", stream=i % 3 == 0, first=i % 2) for i in range(FAULT_CALLS)]
        limited = [Call(i, "limited", stream=False, first=i % 2) for i in range(LIMITED_CALLS)]
        chaos = Chaos(cluster, clients)
        began = time.monotonic()
        await asyncio.gather(paced(clients, fault, FAULT_PER_S),
                             paced(clients, limited, LIMITED_PER_S), chaos.run(began))
        window = (began, time.monotonic())
        # Sent again, with the same keys, once every node is back: none may be lost.
        again = [Call(c.index, c.tenant, c.stream, c.first)
                 for c in [*fault, *chaos.probes] if c.outcome != "answered"]
        resent = list(await asyncio.gather(*(clients.send(c) for c in again)))
        # A client that gives up on a call still running and sends it to the other
        # gateway with the same key (non-streamed: a stream would be kept for a resume).
        impatient = [Call(FIRST_IMPATIENT + i, "fault", stream=False, first=0,
                          first_attempt_s=IMPATIENT_S) for i in range(IMPATIENT)]
        impatient = list(await asyncio.gather(*(clients.send(c) for c in impatient)))
        return Run(cluster.seed, [*fault, *chaos.probes], limited, resent, impatient,
                   chaos.marks, chaos.recovery, window, _redis_said(cluster, chaos))
    finally:
        await clients.close()


def _redis_said(cluster: Cluster, chaos: Chaos) -> str:
    if cluster.redis is None:
        return "one Redis on its own node (no failover)"
    shards = [f"{first}-{last}: {master} + {', '.join(replicas)}"
              for first, last, master, replicas in cluster.redis.slots()]
    return (f"a Redis Cluster, masters + replicas by slots after the test: {'; '.join(shards)}"
            f"; master {chaos.failed_over} (slots of {FAILOVER_TAG}, {{echo-mn}}, "
            f"{{limited}}) SIGKILLed, {chaos.promoted} promoted")


def _settled(cluster: Cluster, result: Run) -> None:
    """Wait until the audit log holds the last calls' events: each impatient call's
    two (its first request's, cancelled when its client left, settled by the first
    gateway; the retry's, run afresh), and the audit stream is empty (the writer
    deletes what it stored). A gateway's recorder writes its events in order, so the
    earlier calls' events are in too."""
    assert all(c.rid for c in result.impatient), [c.attempts for c in result.impatient]
    query = (f"SELECT request_excerpt FROM {AuditEvent._meta.db_table} "  # noqa: S608
             "WHERE chain = 'fault' AND request_excerpt LIKE 'call 6%%'")
    rds = cluster.platform.redis()
    try:
        with psycopg.connect(cluster.platform.database_url, autocommit=True) as conn:
            def written() -> bool:
                seen = Counter(index_of(row[0]) for row in conn.execute(query).fetchall())
                return all(seen[c.index] >= 2 for c in result.impatient) and \
                    rds.xlen(audit.STREAM) == 0
            services.wait_until(written, 60, "the audit writer to catch up",
                                cluster.platform.logs.tail)
    finally:
        rds.close()


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    reason = netns.unavailable() or services.missing_tools()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the multi-node test cannot run in CI: {reason}")
        pytest.skip(f"multi-node fault test skipped: {reason}")
    fabric = netns.Fabric.create()
    tmp = Path(tempfile.mkdtemp(prefix="slc-run-"))  # logs and state directories
    keep = bool(os.environ.get("SLUICE_MULTINODE_KEEP"))  # keep the logs of a passing run
    pg_data = Path(tempfile.mkdtemp(prefix="slc-pg-"))
    logs = services.Logs(tmp)
    try:
        try:
            building = time.monotonic()
            cluster = _build(fabric, logs, pg_data)
            built_s = time.monotonic() - building
            result = asyncio.run(_load(cluster))
            _settled(cluster, result)
            result.report = cluster.platform.ops("report")
            result.figures = {"nodes built and serving in": f"{built_s:.1f} s",
                              **_figures(result)}
        except BaseException:
            keep = True
            raise
        dump = os.environ.get("SLUICE_MULTINODE_DUMP")  # every call's attempts, as JSON
        if dump:
            Path(dump).write_text(json.dumps({"marks": result.marks, "calls": [
                asdict(c) for c in [*result.calls, *result.limited, *result.resent,
                                    *result.impatient]]}))
        print("\nmulti-node fault test:", *(f"  {k}: {v}" for k, v in result.figures.items()),
              sep="\n")
        yield result
    finally:
        fabric.close()
        logs.close()
        shutil.rmtree(pg_data, ignore_errors=True)
        if keep:
            print(f"\nmulti-node test: the nodes' logs are in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _answered_rids(result: Run) -> dict[int, set[str]]:
    """Per call index of the fault tenant: the request ids the audit log shows answered
    (status 200, not cancelled: a request cancelled when its client left answered no
    one). Two ids for one index: the call ran twice."""
    out: dict[int, set[str]] = {}
    for row in result.report["tenants"]["fault"]["calls"]:
        index = index_of(row["excerpt"])
        if index is not None and row["status"] == 200 and row["rid"] \
                and row["finish"] != "cancelled":
            out.setdefault(index, set()).add(row["rid"])
    return out


def _ran(result: Run) -> dict[str, int]:
    """The fault tenant's request ids audited as run (status 200; those cancelled when
    their client left included: billed what they made), with their tokens: each ran
    once, whichever gateways answered it."""
    return {row["rid"]: row["tokens"] for row in result.report["tenants"]["fault"]["calls"]
            if row["status"] == 200 and row["rid"]}


def _figures(result: Run) -> dict[str, Any]:
    calls = [*result.calls, *result.limited]
    outcomes = Counter(c.outcome for c in calls)
    resent_answered = sum(1 for c in result.resent if c.outcome == "answered")
    twice = sum(1 for rids in _answered_rids(result).values() if len(rids) > 1)
    rates = measure_rate(result.limited, result.seed["limit_per_minute"])
    fault_quota = result.report["tenants"]["fault"]["quota"]
    ran = _ran(result)
    refusals = Counter(f"{a.status} {a.code}" for c in calls for a in c.attempts[-1:]
                       if c.outcome == "refused")
    start, end = result.load_window
    cut, kill = result.marks["cut gw1"], result.marks["kill w1+gw2"]
    return {
        "redis": result.redis,
        "calls sent": len(calls),
        "answered": outcomes["answered"],
        "refused retriably (status)": outcomes["refused"],
        "refusals by status and code": dict(refusals),
        "gave up after connection errors (resent later)": outcomes["gave_up"],
        "retried on the other gateway": sum(1 for c in calls if c.retries),
        "calls in flight at gateway 1's cut / gateway 2's kill": (
            f"{len(in_flight_at(calls, 0, cut))} / {len(in_flight_at(calls, 1, kill))}"),
        "resent after the faults / answered then": f"{len(result.resent)} / {resent_answered}",
        "lost (never answered, even when resent)": len(result.resent) - resent_answered,
        "answered twice (two executions of one key)": twice,
        "bad (wrong reply or non-retriable error)": outcomes["bad"],
        "fault tenant: requests charged / request ids audited as run":
            f"{fault_quota['requests']} / {len(ran)}",
        "rate limit: attempts admitted, refused by the limit, in": (
            f"{rates.admitted}, {rates.refused_by_limit}, {rates.span_s:.1f} s"),
        "rate-limit overshoot, whole run / worst 10 s window (burst)": (
            f"{rates.overshoot:.1f} / {rates.worst_window_overshoot:.1f} "
            f"({result.seed['burst']})"),
        **{f"recovery: {k}": f"{v:.2f} s" for k, v in result.recovery.items()},
        "longest time with no call answered during the load":
            f"{longest_gap(result.calls, start, end):.2f} s",
        "slowest call": f"{max(c.ended - c.started for c in calls):.2f} s",
        "impatient calls answered whole / sent": (
            f"{sum(1 for c in result.impatient if c.outcome == 'answered')} / "
            f"{len(result.impatient)}"),
        "audit events / chain problems": (f"{result.report['audit_events']} / "
                                          f"{len(result.report['audit_problems'])}"),
    }


def test_every_call_is_answered_once_or_refused_retriably_within_its_deadline(
        run: Run) -> None:
    calls = [*run.calls, *run.limited, *run.resent]
    bad = [(c.key, c.text, [(a.kind, a.status, a.code, a.error) for a in c.attempts])
           for c in calls if c.outcome == "bad"]
    assert not bad, bad
    late = [(c.key, round(c.ended - c.started, 2)) for c in calls
            if c.ended - c.started > DEADLINE_S + 1.0]
    assert not late, late
    for call in calls:
        last = call.attempts[-1]
        if call.outcome == "refused":
            assert last.status in RETRIABLE, (call.key, last)
            assert last.code, (call.key, last)
            if last.status in (429, 503) and not last.event:
                assert last.retry_after, f"{call.key}: a retriable refusal says when to retry"
    # None lost: what was not answered under the faults is answered when sent again.
    assert [c.key for c in run.resent if c.outcome != "answered"] == []
    # Not vacuous: the faults met calls, and most calls were answered through them.
    assert in_flight_at(run.calls, 0, run.marks["cut gw1"]), "the cut met no call"
    assert in_flight_at(run.calls, 1, run.marks["kill w1+gw2"]), "the kill met no call"
    if "kill redis master" in run.marks:
        failover = run.marks["kill redis master"]
        assert in_flight_at(run.calls, 0, failover) or in_flight_at(run.calls, 1, failover), \
            "the Redis failover met no call"
    assert sum(1 for c in run.calls if c.outcome == "answered") >= FAULT_CALLS * 0.8
    # Exactly once: one execution per key, one final event per request, and the reply
    # the client got is the execution the audit log shows.
    ran = _answered_rids(run)
    assert {i: r for i, r in ran.items() if len(r) > 1} == {}
    finals = [(row["rid"], row["finals"]) for row in run.report["tenants"]["fault"]["calls"]
              if row["status"] == 200 and row["finals"] != 1]
    assert finals == []
    seen = {c.index: c.rid for c in [*run.calls, *run.resent] if c.outcome == "answered"}
    mismatched = {i: (rid, ran.get(i)) for i, rid in seen.items()
                  if i in ran and ran[i] != {rid}}
    assert mismatched == {}


def test_nothing_is_charged_twice(run: Run) -> None:
    """The fault tenant's quota counters hold each request id at most once: at most the
    distinct ids that ran (a replay charges only a request nobody charged), and the
    usage counters (Redis, rolled up into PostgreSQL) agree with them."""
    tenant = run.report["tenants"]["fault"]
    ran = _ran(run)
    quota, usage = tenant["quota"], tenant["usage"]
    assert quota["requests"] <= len(ran), (quota, len(ran))
    assert quota["tokens"] <= sum(ran.values()), (quota, sum(ran.values()))
    assert (usage["requests"], usage["tokens"]) == (quota["requests"], quota["tokens"])
    # Answered on the first attempt by a gateway that lived on: settled by it, charged.
    killed = run.marks["kill w1+gw2"]
    surely = {c.rid for c in run.calls if c.outcome == "answered" and c.retries == 0
              and not (c.attempts[0].gateway == 1 and killed - 1.0 <= c.ended <= killed)}
    assert quota["requests"] >= len(surely), (quota, len(surely))


def test_every_answered_call_is_charged(run: Run) -> None:
    """Every request id that ran is charged, also one in flight on the killed gateway:
    the retry that replayed it charged it (issue #32's first finding)."""
    quota = run.report["tenants"]["fault"]["quota"]
    assert quota["requests"] == len(_ran(run)), (quota, len(_ran(run)))


def test_a_retry_after_a_client_timeout_gets_the_whole_reply(run: Run) -> None:
    """The first gateway cancelled the call when its client left and freed its key (or
    the retry, finding it cancelled, ran it afresh): never the cut reply (issue #32's
    second finding)."""
    got = [(c.key, c.text, [a.kind for a in c.attempts]) for c in run.impatient]
    assert [c.outcome for c in run.impatient] == ["answered"] * IMPATIENT, got


def test_the_rate_limit_holds_across_gateways(run: Run) -> None:
    """A token bucket admits at most rate x T + burst over any interval T, whichever
    gateway a call reaches (the buckets are shared in Redis)."""
    rates = measure_rate(run.limited, run.seed["limit_per_minute"])
    burst = run.seed["burst"]
    assert rates.overshoot <= burst, rates
    assert rates.worst_window_overshoot <= burst, rates
    # Not vacuous: the limit refused calls, and both gateways admitted some.
    assert rates.refused_by_limit >= LIMITED_CALLS // 3, rates
    gateways = {a.gateway for c in run.limited for a in c.attempts if a.kind == "answered"}
    assert gateways == {0, 1}, gateways


def test_the_audit_chains_verify(run: Run) -> None:
    assert run.report["audit_problems"] == []
    audited = {row["rid"] for row in run.report["tenants"]["fault"]["calls"]}
    assert len(audited) >= FAULT_CALLS * 0.8, len(audited)
