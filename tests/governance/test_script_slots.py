"""Every Lua script Sluice runs keeps its KEYS in one Redis Cluster slot, and every
pipeline is non-transactional: what lets a Redis Cluster serve every feature (a script
whose keys span slots is refused, CROSSSLOT; a MULTI cannot span nodes).

The call sites are found in the source (every `.script(`, `.eval(`, `.evalsha(`,
`.register_script(` and recorder `.write(` of a *_LUA script), so a new one fails here
until its keys are listed below; each listed site's keys are built with the same key
functions the site calls, for several tenants and deployments, and must hash to one slot
(redis-py's key_slot, what CLUSTER KEYSLOT computes). tests/sluice/test_redis_cluster.py
runs the sites for real against a cluster."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from redis.crc import key_slot

from governance import breaker, quota, ratelimit, signals, usage
from governance.models import Quota, RateLimitPolicy, RateLimitScope
from governance.recorder import deployment_mark
from inference import autoscaler
from inference import queue as q
from streaming.apis.responses import copy as responses_copy
from streaming.batches import runner as batch_runner
from streaming.models import Batch
from tenants import throttle

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
APPS = ["inference", "governance", "tenants", "streaming", "frontend", "platform/sluice"]
TENANTS = ["alice", "b", "x-1", "a" * 63]
DEPLOYMENTS = ["echo", "Qwen2.5-0.5B_instruct", "m.v2", "z" * 100]
WRITER = "0123abcd4567ef89"

# The plumbing that runs its caller's script with its caller's keys (ScriptBatch,
# Coalescer, the recorder's queued writes): checked at the callers.
CARRIERS = {
    ("platform/sluice/redis.py", "sha1(source)"), ("platform/sluice/redis.py", "source"),
    ("platform/sluice/redisdirect.py", "sha1(source)"),
    ("platform/sluice/redisdirect.py", "source"),
    ("governance/recorder.py", "script"),
}


def _quotas(n: int) -> list[Quota]:
    return [Quota(pk=pk) for pk in range(1, n + 1)]


def _buckets(tenant: str) -> list[ratelimit.Bucket]:
    out = []
    for pk, scope in ((7, RateLimitScope.TENANT), (8, RateLimitScope.API_KEY),
                      (9, RateLimitScope.MODEL)):
        policy = RateLimitPolicy(pk=pk, scope=scope, requests_per_minute=60,
                                 tokens_per_minute=6000)
        out += ratelimit.buckets_for(policy, tenant=tenant, subject=f"{scope}-subject",
                                     factor=0.5)
    return out


def _once(keys: list[str], mark: str) -> list[str]:
    return usage.once_per_flush(keys, [], mark=mark, flush=3)[0]


def _attempt(account: str, source: str | None) -> throttle.Attempt:
    return throttle.Attempt(method=throttle.PASSWORD, account=account, source=source)


def _per_tenant(keys: Callable[[str], list[str]]) -> Iterator[list[str]]:
    return (keys(t) for t in TENANTS)


def _per_deployment(keys: Callable[[str], list[str]]) -> Iterator[list[str]]:
    return (keys(d) for d in DEPLOYMENTS)


def _rids(n: int) -> list[str]:
    return [f"{i:024x}" for i in range(n)]


# (file, the script as the call names it) -> the KEYS lists that site sends.
SITES: dict[tuple[str, str], Callable[[], Iterator[list[str]]]] = {
    ("inference/client.py", "q.ENQUEUE_LUA"): lambda: (
        q.queue_keys(d, q.stream_suffix(t, p))
        for d, t, p in itertools.product(DEPLOYMENTS, TENANTS, (0, q.MAX_PRIORITY))),
    ("inference/engine/intake.py", "q.CLEANUP_LUA"): lambda: (
        [q.stream_key(d, q.stream_suffix(t, 3)), q.streams_key(d)]
        for d, t in itertools.product(DEPLOYMENTS, TENANTS)),
    ("inference/engine/writer.py", "q.ACKS_LUA"): lambda: _per_deployment(
        lambda d: q.ack_keys(d, [q.stream_suffix(t, p) for t in TENANTS for p in (0, 5)])),
    ("inference/engine/writer.py", "q.EVENTS_LUA"): lambda: _per_tenant(
        lambda t: [q.out_key(t, rid) for rid in _rids(5) * 2]),
    ("inference/engine/writer.py", "q.FINALS_LUA"): lambda: _per_tenant(
        lambda t: [k for rid in _rids(5) for k in (q.done_key(t, rid), q.out_key(t, rid))]),
    ("inference/autoscaler.py", "_RENEW_LUA"): lambda: iter([[autoscaler.LEADER_KEY]]),
    ("governance/admission.py", "breaker.ADMIT_LUA"): lambda: _per_deployment(breaker.keys),
    ("governance/admission.py", "breaker.RECORD_LUA"): lambda: _per_deployment(breaker.keys),
    ("governance/admission.py", "ratelimit.BUCKETS_LUA"): lambda: _per_tenant(
        lambda t: [b.key for b in _buckets(t)]),
    ("governance/admission.py", "quota.RESERVE_LUA"): lambda: _per_tenant(
        lambda t: quota.keys_for(t, _quotas(4))),
    ("governance/live.py", "quota.PEEK_LUA"): lambda: _per_tenant(
        lambda t: quota.keys_for(t, _quotas(1))),
    ("governance/cluster_metrics.py", "quota.PEEK_LUA"): lambda: _per_tenant(
        lambda t: quota.keys_for(t, _quotas(1))),
    ("governance/live.py", "breaker.PEEK_LUA"): lambda: _per_deployment(breaker.keys),
    ("governance/recorder.py", "quota.SETTLE_LUA"): lambda: _per_tenant(
        lambda t: quota.settle_call(t, _quotas(3), [
            quota.Settlement(str(i), rid, 1, 2, 3, "m|k|")
            for i, rid in enumerate(_rids(5))])[0]),
    ("streaming/pipeline/replay.py", "FREE_LUA"): lambda: _per_tenant(
        lambda t: [q.idem_key(t, "k" * 64), q.done_key(t, _rids(1)[0])]),
    # On a single Redis a keep also takes the stream's key (one round trip); on a
    # cluster, the keys below, and the stream through KEEP_QUEUE_LUA.
    ("streaming/apis/responses/copy.py", "q.KEEP_LUA"): lambda: (
        [responses_copy.copy_key(t, r), responses_copy.forget_key(t, r)]
        for t, r in itertools.product((1, 42, 10**9), ("resp_a", "resp_" + "f" * 48))),
    # (its _RENEW, sent through asyncio.to_thread, takes the same key)
    ("streaming/batches/runner.py", "_RELEASE"): lambda: _per_tenant(
        lambda t: [batch_runner._lock_key(Batch(principal={"tenant_slug": t}))]),
    ("streaming/apis/responses/copy.py", "q.KEEP_QUEUE_LUA"): lambda: iter(
        [[responses_copy.STREAM]]),
    ("inference/engine/writer.py", "q.KEEP_LUA"): lambda: (
        [keep.key + rid, keep.deletions + rid]
        for keep in (responses_copy.keep(t, "u", "{}") for t in (1, 42, 10**9))
        for rid in _rids(3)),
    ("inference/engine/writer.py", "q.KEEP_QUEUE_LUA"): lambda: iter(
        [[responses_copy.keep(1, "u", "{}").stream]]),
    ("streaming/apis/responses/copy.py", "_DELETE_LUA"): lambda: (
        [responses_copy.forget_key(t, r), responses_copy.copy_key(t, r)]
        for t, r in itertools.product((1, 42, 10**9), ("resp_a", "resp_" + "f" * 48))),
    ("governance/recorder.py", "CORRECT_LUA"): lambda: _per_tenant(
        lambda t: _once([b.key for b in _buckets(t)], usage.applied_key(t, WRITER, "rl"))),
    ("governance/recorder.py", "LATENCIES_LUA"): lambda: (
        _once(signals.latencies_call(d, {3: 1}, metric)[0], deployment_mark(d, WRITER, metric))
        for d, metric in itertools.product(DEPLOYMENTS, ("lat", "ttft"))),
    ("governance/recorder.py", "OUTCOMES_LUA"): lambda: _per_deployment(
        lambda d: _once(breaker.keys(d), deployment_mark(d, WRITER, "br"))),
    ("governance/usage.py", "COUNT_LUA"): lambda: _per_tenant(
        lambda t: _once([usage.usage_key(t, "2025-01-31")], usage.applied_key(t, WRITER))),
    **{("tenants/throttle.py", name): (lambda: (
        throttle._account_keys(_attempt(account, source))
        for account, source in itertools.product(("Alice", "bob@example.com", ""),
                                                 ("203.0.113.9", "2001:db8::1", None))))
       for name in ("ACCOUNT_CHECK_LUA", "ACCOUNT_FAIL_LUA", "SUCCESS_LUA")},
    **{("tenants/throttle.py", name): (lambda: (
        [throttle._source_key(source)] for source in ("203.0.113.9", "2001:db8::1")))
       for name in ("SOURCE_CHECK_LUA", "SOURCE_FAIL_LUA")},
}

_SCRIPT_CALLS = {"script", "eval", "evalsha", "register_script"}


def _app_files() -> Iterator[tuple[str, ast.Module]]:
    for root in APPS:
        for path in sorted((REPO / root).rglob("*.py")):
            if "migrations" not in path.parts:
                yield str(path.relative_to(REPO)), ast.parse(path.read_text())


def _calls(attrs: set[str]) -> Iterator[tuple[str, int, ast.Call]]:
    for name, tree in _app_files():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in attrs:
                yield name, node.lineno, node


def script_sites() -> set[tuple[str, str]]:
    """(file, script expression) of every script call in the apps."""
    found = set()
    for name, _line, call in _calls(_SCRIPT_CALLS | {"write"}):
        if not call.args:
            continue
        script = ast.unparse(call.args[0])
        if call.func.attr == "write" and not script.endswith("_LUA"):
            continue  # a file's or a socket's write
        found.add((name, script))
    return found


def test_every_script_call_site_is_listed() -> None:
    found = script_sites() - CARRIERS
    assert found == set(SITES), {"not listed here": sorted(found - set(SITES)),
                                 "listed but gone": sorted(set(SITES) - found)}


@pytest.mark.parametrize("site", sorted(SITES), ids=lambda s: f"{s[0]}:{s[1]}")
def test_a_script_call_keeps_its_keys_in_one_slot(site: tuple[str, str]) -> None:
    calls = list(SITES[site]())
    assert calls, "no sample keys: the check would prove nothing"
    for keys in calls:
        assert keys, "a script without keys runs on a random node"
        slots = {key_slot(key.encode()) for key in keys}
        assert len(slots) == 1, (site, sorted(zip(map(key_slot, (k.encode() for k in keys)),
                                                  keys, strict=True)))


def test_different_tenants_and_deployments_spread_over_slots() -> None:
    """Not vacuous: the hash tags put different tenants (and deployments) in different
    slots, so the one-slot check above holds because of the tags, not by accident."""
    assert len({key_slot(q.out_key(t, "r").encode()) for t in TENANTS}) > 1
    assert len({key_slot(q.depth_key(d).encode()) for d in DEPLOYMENTS}) > 1
    assert key_slot(q.out_key("alice", "r").encode()) != key_slot(
        q.done_key("bob", "r").encode())


def test_every_pipeline_is_non_transactional() -> None:
    """A MULTI/EXEC pipeline cannot span a cluster's slots: each pipeline names
    transaction=False (redis-py's cluster pipeline then sends each command to its
    slot's node)."""
    transactional = []
    for name, line, call in _calls({"pipeline"}):
        target = call.func.value
        if isinstance(target, ast.Call) and ast.unparse(target.func) == "super":
            continue  # sluice.redis's cluster clients: their callers' choice, passed on
        flag = next((k.value for k in call.keywords if k.arg == "transaction"), None)
        if not (isinstance(flag, ast.Constant) and flag.value is False):
            transactional.append(f"{name}:{line}")
    assert not transactional, transactional
