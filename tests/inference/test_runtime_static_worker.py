"""The static decode path under the real worker (real Redis, the gateway client): the
worker needs no change to serve it. Replies equal the dynamic runtime's (tests/reference);
a cancelled request frees its slot for the next; a worker whose model raises mid-batch
hands its requests to another static worker, which resumes them where they stopped."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
import redis

from inference.client import InferenceClient
from inference.runtimes.base import SamplingParams
from inference.runtimes.static_lm import StaticCausalLMRuntime
from inference.spec import DeploymentSpec, RuntimeName
from inference.worker import Worker
from sluice.redis import sync_client
from tests.inference.conftest import Result, chat, collect, run, unique
from tests.reference import tiny_reply

STATIC = {"decode": "static"}


def spec(max_batch_size: int = 4) -> DeploymentSpec:
    return DeploymentSpec(unique("tiny"), RuntimeName.TINY_CAUSAL_LM,
                          max_batch_size=max_batch_size, extra=dict(STATIC))


def test_replies_and_a_cancellation_through_a_static_worker(
        thread_worker: Callable[..., Worker], redis_url: str) -> None:
    deployment = spec()
    worker = thread_worker(deployment)
    assert isinstance(worker.runtime, StaticCausalLMRuntime)
    texts = [f"request {i}: tell me about the sea" for i in range(6)]
    expected = [tiny_reply(t, SamplingParams(max_tokens=12)) for t in texts]

    async def go(client: InferenceClient) -> list[Result]:
        long = await client.submit(deployment, tenant="t", job=chat("z" * 50, max_tokens=200,
                                                                    ignore_eos=True))
        events = []
        async for event in long.events():
            events.append(event)
            if len(events) == 3:
                await long.cancel()
        assert events[-1]["t"] == "done" and events[-1]["finish"] == "cancelled"
        # Six requests on four slots: they queue, join as slots free, and each gets
        # what it gets alone on the dynamic runtime.
        handles = [await client.submit(deployment, tenant="t", job=chat(t, max_tokens=12))
                   for t in texts]
        return await asyncio.gather(*[collect(h) for h in handles])

    results = run(go, redis_url)
    assert [r.text for r in results] == expected
    assert all(r.final["t"] == "done" for r in results)
    deadline = time.monotonic() + 10
    while worker.runtime.active:  # the last drop follows the final event
        assert time.monotonic() < deadline, "the worker kept sequences"
        time.sleep(0.01)
    assert worker.runtime.kv_used_tokens() == 0


@pytest.mark.slow
def test_a_static_worker_whose_model_raises_is_taken_over_and_resumed(
        rds: redis.Redis, redis_url: str) -> None:
    """The toy model raises on its sixth forward pass in the first worker: a second
    static worker takes its requests over and resumes them (prompt plus what was
    streamed, as a new sequence in its slots); every reply is the uninterrupted one."""
    deployment, tokens = spec(max_batch_size=8), 16
    texts = [f"request {i}: tell me about the sea" for i in range(6)]
    expected = [tiny_reply(t, SamplingParams(max_tokens=tokens)) for t in texts]
    victim = Worker(deployment, sync_client(redis_url), reclaim_after_ms=20_000,
                    block_ms=50)
    forwards = 0

    def fault(_module: object, _args: object) -> None:
        nonlocal forwards
        forwards += 1
        if forwards == 6:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    victim.runtime.model.register_forward_pre_hook(fault)  # type: ignore[union-attr]
    crashed = threading.Event()

    def run_victim() -> None:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            victim.run(drain_s=1)
        crashed.set()

    threading.Thread(target=run_victim, daemon=True).start()
    survivor = Worker(deployment, sync_client(redis_url), reclaim_after_ms=20_000,
                      block_ms=50)

    async def go(client: InferenceClient) -> list[Result]:
        handles = [await client.submit(deployment, tenant="t", job=chat(t, max_tokens=tokens),
                                       timeout_s=60) for t in texts]
        while not crashed.is_set():
            await asyncio.sleep(0.01)
        threading.Thread(target=survivor.run, kwargs={"drain_s": 1}, daemon=True).start()
        return await asyncio.gather(*[collect(h) for h in handles])

    try:
        results = run(go, redis_url)
    finally:
        survivor.stopping.set()
    assert [r.text for r in results] == expected
    assert sum(len(batch) for batch in victim.admitted) > 0 and survivor.admitted
    assert all(r.final["t"] == "done" for r in results)
