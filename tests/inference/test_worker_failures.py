"""Worker processes dying: kill -9 mid-batch answers every request exactly once with the
full, duplicate-free output; a request that keeps killing workers is dead-lettered, and
a poison request is dead-lettered without its neighbours; a worker whose model raises
hands its requests back at once; SIGTERM drains and hands the rest back uncounted; a
stopped worker leaves its runtime empty."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from typing import Any

import jsonschema
import pytest
import redis

from inference import queue as q
from inference.client import InferenceClient
from inference.runtimes.base import ChatRuntime, SamplingParams
from inference.runtimes.causal_lm import CausalLMRuntime
from inference.spec import DeploymentSpec, RuntimeName
from inference.worker import Worker
from sluice.redis import sync_client
from tests.inference.conftest import ProcessWorkers, Result, chat, collect, run, unique
from tests.reference import tiny_reply

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def prompt(i: int) -> str:
    return f"request {i:02d} " + "abcdefghij" * 3


def done_events(rds: redis.Redis, tenant: str, rid: str) -> int:
    return sum(1 for _i, f in rds.xrange(q.out_key(tenant, rid))
               if b'"t":"done"' in f[b"e"] or b'"t":"error"' in f[b"e"])


def test_kill_9_mid_batch_every_request_answered_exactly_once(
        process_workers: ProcessWorkers, rds: redis.Redis, redis_url: str) -> None:
    spec = DeploymentSpec(unique("echo"), RuntimeName.ECHO, max_batch_size=8,
                          echo_token_delay_ms=25, max_queue_depth=64)
    victim = process_workers.start(spec, reclaim_after_ms=1000)
    process_workers.wait_live(rds, spec.name, 1)
    survivor = process_workers.start(spec, reclaim_after_ms=1000)
    process_workers.wait_live(rds, spec.name, 2)

    async def go(client: InferenceClient) -> None:
        handles = [await client.submit(spec, tenant=f"t{i % 3}", job=chat(prompt(i)),
                                       timeout_s=60) for i in range(16)]
        def held_by_victim() -> int:
            return sum(
                1 for suffix in rds.hkeys(q.streams_key(spec.name))
                for e in rds.xpending_range(q.stream_key(spec.name, suffix.decode()),
                                            q.GROUP, "-", "+", 100)
                if f"-{victim.pid}-" in e["consumer"].decode())
        # Killed only once it holds requests mid-generation (on a loaded machine its
        # first read can come late): what it held must then be taken over.
        deadline = time.monotonic() + 30
        while not held_by_victim() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        os.kill(victim.pid, signal.SIGKILL)
        assert held_by_victim() > 0, "the victim died holding requests: they must be taken over"
        results = await asyncio.gather(*[collect(h) for h in handles])
        for i, (handle, result) in enumerate(zip(handles, results, strict=True)):
            assert result.final["t"] == "done", result.final
            assert result.text == prompt(i), "no token lost or repeated across the takeover"
            seqs = [e["seq"] for e in result.events]
            assert seqs == sorted(set(seqs)), "every event delivered once, in order"
            assert result.final["usage"]["completion_tokens"] == len(prompt(i).encode())
            assert done_events(rds, handle.tenant, handle.rid) == 1, "one final event: one charge"

    run(go, redis_url)
    assert victim.wait(5) == -signal.SIGKILL and survivor.poll() is None
    assert int(rds.get(q.depth_key(spec.name)) or 0) == 0
    assert rds.hlen(q.tenants_key(spec.name)) == 0


def test_request_that_keeps_killing_workers_goes_to_dead_letter(
        process_workers: ProcessWorkers, rds: redis.Redis, redis_url: str) -> None:
    spec = DeploymentSpec(unique("echo"), RuntimeName.ECHO, max_batch_size=1,
                          echo_token_delay_ms=50, max_deliveries=2)
    stream = None

    async def go(client: InferenceClient) -> None:
        nonlocal stream
        handle = await client.submit(spec, tenant="t", job=chat("poison " * 20), timeout_s=60)
        stream = q.stream_key(spec.name, q.stream_suffix("t", 0))
        kills = 0
        deadline = time.monotonic() + 45
        result_task = asyncio.create_task(collect(handle))
        while not result_task.done() and time.monotonic() < deadline:
            if not any(p.poll() is None for p in process_workers.procs):
                process_workers.start(spec, reclaim_after_ms=500)
            # Whenever a worker holds the request to run it, it "crashes" on it. (Past
            # max_deliveries the worker holds it only to dead-letter it.)
            for entry in rds.xpending_range(stream, q.GROUP, "-", "+", 10):
                if entry["times_delivered"] > spec.max_deliveries:
                    continue
                owner = entry["consumer"].decode()
                for proc in process_workers.procs:
                    if proc.poll() is None and f"-{proc.pid}-" in owner:
                        proc.kill()
                        proc.wait()
                        kills += 1
            await asyncio.sleep(0.05)
        result = await result_task
        assert result.final["t"] == "error" and result.final["code"] == "dead_lettered"
        assert kills == spec.max_deliveries
        dead = rds.xrange(q.dead_key(spec.name))
        assert len(dead) == 1 and dead[0][1][b"rid"].decode() == handle.rid

    run(go, redis_url)
    assert int(rds.get(q.depth_key(spec.name)) or 0) == 0


def test_sigterm_drains_running_work_and_hands_back_the_rest(
        process_workers: ProcessWorkers, rds: redis.Redis, redis_url: str) -> None:
    spec = DeploymentSpec(unique("echo"), RuntimeName.ECHO, max_batch_size=2,
                          echo_token_delay_ms=10)
    first = process_workers.start(spec, reclaim_after_ms=60_000)
    process_workers.wait_live(rds, spec.name, 1)

    async def go(client: InferenceClient) -> None:
        handles = [await client.submit(spec, tenant="t", job=chat(prompt(i)), timeout_s=60)
                   for i in range(6)]
        await asyncio.sleep(0.3)
        first.terminate()
        assert first.wait(15) == 0
        # Handed back uncounted: a stop is not a failure (the next taker's delivery
        # brings them to 1 again, far from max_deliveries).
        held = [e for suffix in rds.hkeys(q.streams_key(spec.name))
                for e in rds.xpending_range(q.stream_key(spec.name, suffix.decode()),
                                            q.GROUP, "-", "+", 100)]
        assert held and all(e["consumer"] == b"released" and e["times_delivered"] == 0
                            for e in held), held
        # A fresh worker takes the handed-back entries at once, not after 60 s.
        process_workers.start(spec, reclaim_after_ms=60_000)
        results = await asyncio.wait_for(asyncio.gather(*[collect(h) for h in handles]), 30)
        assert [r.text for r in results] == [prompt(i) for i in range(6)]

    run(go, redis_url)


def faulty_worker(spec: DeploymentSpec, redis_url: str, reclaim_ms: int, *,
                  at_forward: int) -> tuple[Worker, list[float]]:
    """A worker, running in a thread, whose toy model raises on its `at_forward`th
    forward pass (a transient device error, injected), and the list its crash time is
    appended to once it has handed its requests back and exited."""
    victim = Worker(spec, sync_client(redis_url), reclaim_after_ms=reclaim_ms,
                    block_ms=50)
    assert isinstance(victim.runtime, CausalLMRuntime)
    forwards = 0

    def fault(_module: object, _args: object) -> None:
        nonlocal forwards
        forwards += 1
        if forwards == at_forward:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    victim.runtime.model.register_forward_pre_hook(fault)
    crashed: list[float] = []

    def run_victim() -> None:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            victim.run(drain_s=1)
        crashed.append(time.monotonic())

    threading.Thread(target=run_victim, daemon=True).start()
    return victim, crashed


def test_a_worker_whose_model_raises_hands_its_requests_back_at_once(
        rds: redis.Redis, redis_url: str) -> None:
    """The model raises mid-batch (a transient device error, injected: the toy model's
    forward raises once). The worker exits with the error (crash-only: a CUDA error can
    leave a process unusable) but first writes what it made and releases what it held,
    so a live worker takes it over at its next reap instead of after reclaim_after_ms of
    silence (20 s here); every request ends once, with exactly the text it has without
    the fault."""
    reclaim_ms, tokens = 20_000, 16
    spec = DeploymentSpec(unique("tiny"), RuntimeName.TINY_CAUSAL_LM, max_batch_size=8)
    texts = [f"request {i}: tell me about the sea" for i in range(6)]
    expected = [tiny_reply(t, SamplingParams(max_tokens=tokens)) for t in texts]
    victim, crashed = faulty_worker(spec, redis_url, reclaim_ms, at_forward=6)
    survivor = Worker(spec, sync_client(redis_url), reclaim_after_ms=reclaim_ms,
                      block_ms=50)

    async def go(client: InferenceClient) -> tuple[list[Result], float]:
        handles = [await client.submit(spec, tenant="t", job=chat(t, max_tokens=tokens),
                                       timeout_s=60) for t in texts]
        while not crashed:
            await asyncio.sleep(0.01)
        threading.Thread(target=survivor.run, kwargs={"drain_s": 1}, daemon=True).start()
        results = await asyncio.gather(*[collect(h) for h in handles])
        return results, time.monotonic() - crashed[0]

    try:
        results, after_crash_s = run(go, redis_url)
    finally:
        survivor.stopping.set()
    assert [r.text for r in results] == expected
    for result in results:
        assert result.final["t"] == "done", result.final
        seqs = [e["seq"] for e in result.events]
        assert seqs == sorted(set(seqs)), "every event delivered once, in order"
    assert after_crash_s < 8, f"taken over {after_crash_s:.1f} s after the crash"
    streamed = sum(1 for batch in victim.admitted for _ in batch)
    assert streamed > 0 and survivor.admitted, "both workers served"


def test_a_structured_reply_taken_over_mid_stream_is_still_one_valid_value(
        rds: redis.Redis, redis_url: str) -> None:
    """Structured outputs across a takeover: the worker that resumes a request replays
    what was streamed through the schema's constraint, so the reply goes on from
    inside the JSON value instead of starting a second one (random weights: only the
    constraint makes it valid)."""
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "score": {"type": "number"},
        "ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}}}
    spec = DeploymentSpec(unique("tiny"), RuntimeName.TINY_CAUSAL_LM, max_batch_size=8)
    _victim, crashed = faulty_worker(spec, redis_url, 20_000, at_forward=8)
    survivor = Worker(spec, sync_client(redis_url), block_ms=50)

    async def go(client: InferenceClient) -> tuple[list[Result], int]:
        handles = [await client.submit(spec, tenant="t", timeout_s=60, job=chat(
            f"describe item {i}", max_tokens=150, temperature=1.0, seed=i,
            response_format={"schema": schema})) for i in range(4)]
        while not crashed:
            await asyncio.sleep(0.01)
        partial = sum(1 for h in handles if any(
            b'"t":"delta"' in f[b"e"] for _i, f in rds.xrange(q.out_key(h.tenant, h.rid))))
        threading.Thread(target=survivor.run, kwargs={"drain_s": 1}, daemon=True).start()
        return await asyncio.gather(*[collect(h) for h in handles]), partial

    try:
        results, partial = run(go, redis_url)
    finally:
        survivor.stopping.set()
    assert partial, "the victim streamed part of a reply before it failed"
    assert survivor.admitted, "the survivor finished them"
    for result in results:
        assert result.final["t"] == "done" and result.final["finish"] == "stop", result.final
        jsonschema.validate(json.loads(result.text), schema)


def test_a_poison_request_is_dead_lettered_without_its_neighbours(
        rds: redis.Redis, redis_url: str) -> None:
    """A request whose input makes the model raise every time (injected: the toy
    model's forward raises whenever one token is in its input) kills every worker that
    runs it, and its neighbours' batches with it. On a request's last allowed delivery
    it runs alone: the neighbours finish with exactly their fault-free text, and only
    the poison is dead-lettered (before, the whole batch went to the dead letters)."""
    tokens = 8
    spec = DeploymentSpec(unique("tiny"), RuntimeName.TINY_CAUSAL_LM, max_batch_size=8,
                          max_deliveries=3)
    neighbours = [f"neighbour {i}: tell me about the sea" for i in range(4)]
    expected = [tiny_reply(t, SamplingParams(max_tokens=tokens)) for t in neighbours]
    crashes: list[str] = []
    workers: list[Worker] = []
    done = threading.Event()

    def serve() -> None:  # what the autoscaler does: a worker that dies is replaced
        while not done.is_set() and len(crashes) < 6:
            worker = Worker(spec, sync_client(redis_url), block_ms=50)
            assert isinstance(worker.runtime, CausalLMRuntime)
            poison = worker.runtime.encode(" zebra")[0]

            def fault(_module: object, _args: object, kwargs: dict[str, Any]) -> None:
                if bool((kwargs["input_ids"] == poison).any()):  # noqa: B023
                    raise RuntimeError("the model cannot take this input")

            worker.runtime.model.register_forward_pre_hook(fault, with_kwargs=True)
            workers.append(worker)
            try:
                worker.run(drain_s=1)
                return
            except RuntimeError:
                crashes.append(worker.id)

    serving = threading.Thread(target=serve, daemon=True)
    serving.start()

    async def go(client: InferenceClient) -> list[Result]:
        handles = [await client.submit(spec, tenant="t", job=chat(t, max_tokens=tokens),
                                       timeout_s=60)
                   for t in [*neighbours[:2], "a zebra", *neighbours[2:]]]
        return list(await asyncio.gather(*[collect(h) for h in handles]))

    try:
        results = run(go, redis_url)
    finally:
        done.set()
        if workers:
            workers[-1].stopping.set()
        serving.join(10)
    poisoned = results.pop(2)
    assert poisoned.final["t"] == "error" and poisoned.final["code"] == "dead_lettered"
    assert [r.final["t"] for r in results] == ["done"] * 4
    assert [r.text for r in results] == expected
    assert len(crashes) == spec.max_deliveries, crashes
    assert rds.xlen(q.dead_key(spec.name)) == 1


@pytest.mark.parametrize("runtime", [RuntimeName.ECHO, RuntimeName.TINY_CAUSAL_LM])
def test_a_stopped_worker_leaves_its_runtime_empty_for_the_next_one(
        rds: redis.Redis, redis_url: str, runtime: RuntimeName) -> None:
    """A worker stopped mid-stream with no time to drain hands its requests back and
    drops every sequence from its runtime, KV cache included, so that a runtime can
    outlive its worker: a second worker on the same runtime starts from an empty one
    and finishes each request with exactly its uninterrupted reply."""
    spec = DeploymentSpec(unique("stop"), runtime, max_batch_size=4, echo_token_delay_ms=20)
    texts = [f"request {i}: tell me about the sea" for i in range(3)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = ([t[:24] for t in texts] if runtime == RuntimeName.ECHO  # a byte a token
                else [tiny_reply(t, params) for t in texts])
    first = Worker(spec, sync_client(redis_url), block_ms=50)
    shared = first.runtime
    assert isinstance(shared, ChatRuntime)
    stopped = threading.Thread(target=first.run, kwargs={"drain_s": 0}, daemon=True)
    stopped.start()
    second = Worker(spec, sync_client(redis_url), runtime=shared, block_ms=50)
    left: list[str] = []

    async def go(client: InferenceClient) -> list[Result]:
        handles = [await client.submit(spec, tenant="t", timeout_s=60,
                                       job=chat(t, max_tokens=24, ignore_eos=True))
                   for t in texts]
        deadline = time.monotonic() + 30
        while len(first.active) < len(texts):  # all three running on the first worker
            assert time.monotonic() < deadline, "the first worker did not start them"
            await asyncio.sleep(0.01)
        first.stopping.set()
        await asyncio.to_thread(stopped.join, 15)
        assert not stopped.is_alive()
        left.extend(shared.active)
        left.append(str(shared.kv_used_tokens() or ""))
        threading.Thread(target=second.run, kwargs={"drain_s": 1}, daemon=True).start()
        return await asyncio.gather(*[collect(h) for h in handles])

    try:
        results = run(go, redis_url)
    finally:
        second.stopping.set()
    assert left == [""], "the stopped worker left sequences (or KV cache) in its runtime"
    assert [r.text for r in results] == expected
    assert all(r.final["t"] == "done" for r in results)
