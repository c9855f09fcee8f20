"""A live Sluice: the real ASGI app under uvicorn on a loopback port, real workers on the
test Redis, data committed to the test database (transactional_db) so every thread sees
it. Clients are the official openai SDK."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from django.conf import settings

from governance import audit
from governance import cache as policy_cache
from governance import privacy as privacy_cache
from inference import cache as registry_cache
from inference.models import Deployment
from inference.weights import MINILM
from inference.worker import Worker
from sluice.redis import sync_client
from sluice.root.grpcserver import build
from tenants import cache as auth_cache
from tests import runtimes
from tests.conftest import uvicorn_server


@dataclass
class Live:
    base_url: str
    workers: dict[str, Worker]


@pytest.fixture
def live(transactional_db: None) -> Iterator[Live]:
    sync_client(settings.REDIS_URL).flushdb()
    auth_cache.clear()
    registry_cache.clear()
    # An earlier test's prices, policies and privacy settings (cached in-process) are
    # not this one's.
    policy_cache.clear()
    privacy_cache.clear()
    specs = [
        Deployment.objects.create(name="echo", runtime="echo", max_batch_size=8,
                                  echo_token_delay_ms=2),
        Deployment.objects.create(name="slow-echo", runtime="echo", max_batch_size=8,
                                  echo_token_delay_ms=50),
        Deployment.objects.create(name="minilm", runtime="encoder", weights=MINILM,
                                  max_batch_size=16),
        Deployment.objects.create(name="idle", runtime="echo", max_queue_depth=2,
                                  tenant_queue_share=0.5),  # no worker serves it
    ]
    workers: dict[str, Worker] = {}
    threads = []
    for deployment in specs[:3]:
        spec = deployment.to_spec()
        worker = Worker(spec, sync_client(settings.REDIS_URL), runtime=runtimes.take(spec),
                        block_ms=200)
        thread = threading.Thread(target=worker.run, kwargs={"drain_s": 1}, daemon=True)
        thread.start()
        workers[deployment.name] = worker
        threads.append(thread)
    with uvicorn_server() as port:
        yield Live(f"http://127.0.0.1:{port}/v1", workers)
    # The audit stream's last events land before the tables go. The server's loop has
    # ended (its recorder with it): nothing appends now, so no wait for a quiet stream.
    audit.drain(settle_s=0)
    for worker in workers.values():
        worker.stopping.set()
    for worker, thread in zip(workers.values(), threads, strict=True):
        thread.join(10)
        if not thread.is_alive():
            runtimes.give_back(worker.spec, worker.runtime)


def _tiny_worker(name: str, max_context: int) -> Iterator[str]:
    """The toy-weights chat model deployed as `name`, served by a worker thread."""
    spec = Deployment.objects.create(name=name, runtime="tiny_causal_lm",
                                     max_context=max_context, max_batch_size=4).to_spec()
    worker = Worker(spec, sync_client(settings.REDIS_URL), runtime=runtimes.take(spec),
                    block_ms=200)
    thread = threading.Thread(target=worker.run, kwargs={"drain_s": 1}, daemon=True)
    thread.start()
    yield name
    worker.stopping.set()
    thread.join(10)
    if not thread.is_alive():
        runtimes.give_back(spec, worker.runtime)


@pytest.fixture
def tiny(live: Live) -> Iterator[str]:
    """A small-context chat model (toy weights) whose prompt counts show the history."""
    yield from _tiny_worker("tiny", 256)


@pytest.fixture
def roomy(live: Live) -> Iterator[str]:
    """The tiny model with room for a tool prompt, a call and its result: 1,024 tokens of
    context (in "tiny"'s 256, a tool prompt leaves a call ~49 tokens)."""
    yield from _tiny_worker("tiny-roomy", 1024)


@pytest.fixture
def grpc_target(live: Live) -> Iterator[str]:
    started: dict[str, Any] = {}
    stop = threading.Event()

    def run() -> None:
        async def main() -> None:
            server, servicer, port = await build("127.0.0.1:0")
            started["port"] = port
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await server.stop(grace=1)
            await servicer.close()
        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while "port" not in started:
        assert time.monotonic() < deadline, "gRPC server did not start"
        time.sleep(0.02)
    yield f"127.0.0.1:{started['port']}"
    stop.set()
    thread.join(10)


def assert_rate_limited(api: Any, **body: Any) -> None:
    """With the tenant's rate limit at 60 a minute and a burst of 1 (the caller sets it),
    `api` (an openai SDK resource: `client.completions`, `client.responses`) answers one
    call of `body` with the limit's headers and refuses the next with a 429 whose
    headers say when to come back."""
    raw = api.with_raw_response.create(**body)
    assert raw.headers["x-ratelimit-limit-requests"] == "60"
    with pytest.raises(openai.RateLimitError) as caught:
        api.create(**body)
    assert caught.value.code == "rate_limit_requests"
    assert 1 <= int(caught.value.response.headers["retry-after"]) <= 2
    assert caught.value.response.headers["x-ratelimit-remaining-requests"] == "0"


def assert_quota_exhausted(api: Any, **body: Any) -> None:
    """With a quota of one request a minute on the model (the caller sets it), `api` (an
    openai SDK resource) answers one call of `body` and refuses the next, streamed, with
    OpenAI's 429 `insufficient_quota` (before any stream starts)."""
    api.create(**body)
    with pytest.raises(openai.RateLimitError) as caught:
        api.create(**body, stream=True)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["type"] == "insufficient_quota" and error["code"] == "quota_exceeded"
    assert caught.value.type == "insufficient_quota" and caught.value.code == "quota_exceeded"
