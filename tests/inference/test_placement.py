"""Prefix-aware placement among one deployment's workers (inference/routing.py `lane`,
inference/engine/intake.py): calls that share a prefix key go to one worker's lane and
reuse its prefix cache; a live worker's lane waits LANE_STEAL_MS before another worker
takes its entries; a dead worker's lane is anyone's; one worker alone gets no lanes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from inference import queue as q
from inference.client import InferenceClient
from inference.engine import intake
from inference.routing import lane
from inference.spec import DeploymentSpec, RuntimeName
from inference.worker import Worker
from tests.conftest import eventually
from tests.inference.conftest import chat, collect, run, unique

PROMPT = "Summarise the quarterly figures for the northern region in three lines. " * 3


def spec_of(name: str) -> DeploymentSpec:
    return DeploymentSpec(name, RuntimeName.TINY_CAUSAL_LM, max_batch_size=4,
                          max_context=512)


def live(rds: redis.Redis, name: str) -> dict[str, Any]:
    return q.live_heartbeats(rds.hgetall(q.workers_key(name)))


def keys_for(worker: str, beats: dict[str, Any], count: int) -> list[bytes]:
    """`count` prefix keys whose lane is `worker`'s."""
    found: list[bytes] = []
    i = 0
    while len(found) < count:
        key = f"prefix-{i}".encode()
        if lane(key, beats) == worker:
            found.append(key)
        i += 1
    return found


def calls(redis_url: str, spec: DeploymentSpec, keyed: list[tuple[bytes, str]]
          ) -> list[tuple[float, Any]]:
    """Each (prefix key, text) called in turn: (seconds to its end, its final event)."""
    async def go(client: InferenceClient) -> list[tuple[float, Any]]:
        out = []
        for affinity, text in keyed:
            began = time.monotonic()
            handle = await client.submit(spec, tenant="t", job=chat(text, max_tokens=2),
                                         timeout_s=60, affinity=affinity)
            result = await collect(handle)
            out.append((time.monotonic() - began, result.final))
        return out
    return run(go, redis_url)


def test_a_prefix_key_keeps_its_calls_on_one_worker(
        rds: redis.Redis, redis_url: str, thread_worker: Callable[..., Worker]) -> None:
    spec = spec_of(unique("placed"))
    workers = [thread_worker(spec, block_ms=50, heartbeat_s=0.2) for _ in range(2)]
    eventually(lambda: len(live(rds, spec.name)) == 2 and all(
        w.health.others_live for w in workers), 10, what="two live workers that see each other")
    beats = live(rds, spec.name)
    for worker in workers:
        [key] = keys_for(worker.id, beats, 1)
        before = [w.runtime.prefix.stats.lookups for w in workers]  # type: ignore[attr-defined]
        finals = calls(redis_url, spec, [(key, f"{PROMPT} turn {i}") for i in range(4)])
        grew = [w.runtime.prefix.stats.lookups - b  # type: ignore[attr-defined]
                for w, b in zip(workers, before, strict=True)]
        assert grew == [4 if w is worker else 0 for w in workers], grew
        assert all(f["usage"].get("cached_tokens", 0) > 0 for _, f in finals[1:]), finals


@pytest.mark.cluster  # the steal's pipelined XINFO GROUPS and XRANGE, on a cluster too
def test_a_live_workers_lane_waits_then_another_takes_it(
        rds: redis.Redis, redis_url: str, thread_worker: Callable[..., Worker],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A live worker that never reads (a ghost's heartbeat): its lane's calls wait
    LANE_STEAL_MS, then the real worker serves them."""
    monkeypatch.setattr(intake, "LANE_STEAL_MS", 600)
    spec = spec_of(unique("stolen"))
    worker = thread_worker(spec, block_ms=50, heartbeat_s=0.2)
    ghost = {"ts": time.time() + 30, "in_rotation": True, "load": 0, "max_batch": 4}
    rds.hset(q.workers_key(spec.name), "ghost", json.dumps(ghost))
    eventually(lambda: worker.health.others_live == {"ghost"}, 10, what="the ghost seen")
    keys = keys_for("ghost", live(rds, spec.name), 2)
    done = calls(redis_url, spec, [(k, PROMPT) for k in keys])
    assert all(f["t"] == "done" for _, f in done)
    assert min(seconds for seconds, _ in done) >= 0.6


def test_a_dead_workers_lane_is_anyones(
        rds: redis.Redis, redis_url: str, thread_worker: Callable[..., Worker],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Placed in a worker's lane, then the worker died (its heartbeat gone): the others
    read its lane as their own, without waiting to steal."""
    monkeypatch.setattr(intake, "LANE_STEAL_MS", 600_000)
    spec = spec_of(unique("orphan"))
    thread_worker(spec, block_ms=50, heartbeat_s=0.2)
    eventually(lambda: len(live(rds, spec.name)) == 1, 10, what="the worker's heartbeat")
    ghost = {"ts": time.time(), "in_rotation": True, "load": 0, "max_batch": 4}
    beats = {**live(rds, spec.name), "ghost": ghost}
    [key] = keys_for("ghost", beats, 1)
    # The ghost is placed its call's lane (as a gateway would while it was live) ...
    suffix = q.stream_suffix("t", 0, "ghost")
    assert lane(key, beats) == "ghost" and q.suffix_lane(suffix) == "ghost"

    async def go(client: InferenceClient) -> Any:
        client._beats[spec.name] = (time.monotonic(), beats)  # what it last read
        handle = await client.submit(spec, tenant="t", job=chat(PROMPT, max_tokens=2),
                                     timeout_s=60, affinity=key)
        return (await collect(handle)).final
    # ... and is not live for the worker (no heartbeat of its own): served all the same.
    assert run(go, redis_url)["t"] == "done"
    assert rds.hexists(q.streams_key(spec.name), suffix)


def test_one_worker_alone_gets_no_lane() -> None:
    beat = {"ts": time.time(), "in_rotation": True, "load": 0, "max_batch": 4}
    assert lane(b"k", {"w1": beat}) == ""
    assert lane(b"k", {"w1": beat, "w2": {**beat, "in_rotation": False}}) == ""
    both = {"w1": beat, "w2": beat}
    assert lane(b"k", both) in both
    full = lane(b"k", both)
    assert lane(b"k", {**both, full: {**beat, "load": 4}}) == ""  # its batch is full
