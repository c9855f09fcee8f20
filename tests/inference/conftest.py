"""Fixtures for the inference tests: a clean Redis, workers (in a thread, or as real
processes that tests may SIGKILL), and helpers to drive the real gateway client."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from secrets import token_hex
from typing import Any, TypeVar

import msgspec
import pytest
import redis
from django.conf import settings

from inference.client import InferenceClient, RequestHandle
from inference.jobs import ChatJob
from inference.spec import DeploymentSpec
from inference.worker import Worker, heartbeats
from sluice.redis import sync_client
from tests import runtimes

# The live gateway (uvicorn + in-thread workers) for the autoscaler tests.
from tests.streaming.conftest import live  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


@pytest.fixture
def redis_url() -> str:
    return str(settings.REDIS_URL)


@pytest.fixture
def rds(redis_url: str) -> Iterator[redis.Redis]:
    client = sync_client(redis_url)
    client.flushdb()
    yield client
    client.close()


def unique(prefix: str) -> str:
    return f"{prefix}-{token_hex(4)}"


@pytest.fixture
def thread_worker(rds: redis.Redis) -> Iterator[Callable[..., Worker]]:
    """Start a Worker in a thread of this process (real Redis, real runtime: the one
    given, else one lent by tests/runtimes.py)."""
    started: list[tuple[Worker, threading.Thread]] = []

    lent: set[int] = set()  # the workers whose runtime came from tests/runtimes.py

    def start(spec: DeploymentSpec, **kwargs: Any) -> Worker:
        pooled = "runtime" not in kwargs
        if pooled:
            kwargs["runtime"] = runtimes.take(spec)
        worker = Worker(spec, sync_client(str(settings.REDIS_URL)), **kwargs)
        thread = threading.Thread(target=worker.run, kwargs={"drain_s": 2}, daemon=True)
        thread.start()
        started.append((worker, thread))
        if pooled:
            lent.add(id(worker))
        return worker

    yield start
    for worker, _thread in started:
        worker.stopping.set()
    for worker, thread in started:
        thread.join(10)
        if id(worker) in lent and not thread.is_alive():
            runtimes.give_back(worker.spec, worker.runtime)


@dataclass
class ProcessWorkers:
    redis_url: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, spec: DeploymentSpec, *,
              reclaim_after_ms: int = 1000) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "inference.worker", "--spec", spec.to_json(),
             "--redis-url", self.redis_url, "--reclaim-after-ms", str(reclaim_after_ms)],
            cwd=REPO, env={**os.environ, "SLUICE_LOG_LEVEL": "WARNING"},
        )
        self.procs.append(proc)
        return proc

    def wait_live(self, rds: redis.Redis, deployment: str, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(heartbeats(rds, deployment)) < count:
            assert time.monotonic() < deadline, "workers did not come up"
            time.sleep(0.05)


@pytest.fixture
def process_workers(rds: redis.Redis, redis_url: str) -> Iterator[ProcessWorkers]:
    workers = ProcessWorkers(redis_url)
    yield workers
    for proc in workers.procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def run(coro_fn: Callable[[InferenceClient], Awaitable[T]], redis_url: str) -> T:
    """Run `coro_fn(client)` with a started gateway client, in a fresh event loop."""

    async def main() -> T:
        client = InferenceClient(redis_url)
        await client.start()
        try:
            return await coro_fn(client)
        finally:
            await client.close()

    return asyncio.run(main())


@dataclass
class Result:
    text: str
    events: list[dict[str, Any]]

    @property
    def final(self) -> dict[str, Any]:
        return self.events[-1]


async def collect(handle: RequestHandle) -> Result:
    events = [event async for event in handle.events()]
    return Result("".join(e.get("text", "") for e in events if e["t"] == "delta"), events)


def chat(text: str, **params: Any) -> ChatJob:
    """A one-message chat job, greedy unless `params` says otherwise (fields may be
    given as JSON would carry them: tools as dicts)."""
    return msgspec.convert({"messages": [{"role": "user", "content": text}],
                            "temperature": 0.0, **params}, ChatJob)
