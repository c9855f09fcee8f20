"""A model that fails on one request's input (NaN logits, as a half-precision overflow
gives): through the live gateway and the official openai SDK, that request gets a 500
`model_error` the SDK does not retry, the requests sharing its batch finish, and the
worker goes on serving. (Before, the sampler's error stopped the worker: the whole
batch waited for a takeover and, failing every time, the neighbours were dead-lettered
with it.)"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import openai
import pytest
import torch
from django.conf import settings

from inference import queue as q
from inference.models import Deployment
from inference.runtimes.causal_lm import CausalLMRuntime
from inference.worker import Worker
from sluice.redis import sync_client
from streaming.protos import inference_pb2 as pb
from streaming.protos import inference_pb2_grpc as pb_grpc
from tenants.roles import Role
from tests.conftest import make_org
from tests.inference.test_runtimes import alone
from tests.streaming.conftest import Live

pytestmark = pytest.mark.slow

NEIGHBOURS = ["what is two plus two?", "tell me a story", "hello there", "x " * 20]
VICTIM = "a dragon and a knight"  # its greedy output holds the poisoned token
TOKENS = 10


@dataclass
class Faulty:
    worker: Worker
    thread: threading.Thread
    poison: int  # whose embedding turns NaN
    at: int  # the victim's token index that is the poison (the next one fails)


def prefill_prompt(rt: CausalLMRuntime, poison: int) -> str:
    return f"the word is{rt.decode([poison])}"


@pytest.fixture
def faulty(live: Live) -> Iterator[Faulty]:
    spec = Deployment.objects.create(name="faulty", runtime="tiny_causal_lm",
                                     max_context=256, max_batch_size=8).to_spec()
    worker = Worker(spec, sync_client(settings.REDIS_URL), block_ms=50)
    rt = worker.runtime
    assert isinstance(rt, CausalLMRuntime)

    def greedy(content: str) -> tuple[list[int], list[int]]:
        prompt = rt.encode_chat([{"role": "user", "content": content}])
        return prompt, alone(rt, prompt, TOKENS)

    seen: set[int] = set()
    for content in NEIGHBOURS:
        seen.update(*greedy(content))
    prompt, output = greedy(VICTIM)
    at, poison = next((k, t) for k, t in enumerate(output) if 2 <= k <= TOKENS - 2
                      and t not in seen and t not in (*prompt, *output[:k]))
    assert poison in rt.encode_chat([{"role": "user", "content": prefill_prompt(rt, poison)}])
    rt.model.get_input_embeddings().register_forward_hook(
        lambda _module, args, out: out.masked_fill((args[0] == poison)[..., None], torch.nan))
    thread = threading.Thread(target=worker.run, kwargs={"drain_s": 1}, daemon=True)
    thread.start()
    yield Faulty(worker, thread, poison, at)
    worker.stopping.set()
    thread.join(10)


def test_a_request_the_model_fails_on_is_answered_alone_and_not_retried(
        live: Live, faulty: Faulty) -> None:
    key = make_org("alice", [Role.DEVELOPER]).keys[Role.DEVELOPER]
    rt = faulty.worker.runtime
    assert isinstance(rt, CausalLMRuntime)

    async def go() -> tuple[list[object], list[str]]:
        # The SDK's default retries are on: a 5xx would be sent again, unless told not to.
        client = openai.AsyncOpenAI(base_url=live.base_url, api_key=key, max_retries=2,
                                    timeout=60)

        async def ask(content: str) -> object:
            return await client.chat.completions.create(
                model="faulty", messages=[{"role": "user", "content": content}],
                max_tokens=TOKENS, temperature=0)

        async def stream(content: str) -> list[str]:
            parts: list[str] = []
            chunks = await client.chat.completions.create(
                model="faulty", messages=[{"role": "user", "content": content}],
                max_tokens=TOKENS, temperature=0, stream=True)
            async for chunk in chunks:
                parts += [c.delta.content or "" for c in chunk.choices]
            return parts

        parts: list[str] = []

        async def victim_stream() -> None:
            chunks = await client.chat.completions.create(
                model="faulty", messages=[{"role": "user", "content": VICTIM}],
                max_tokens=TOKENS, temperature=0, stream=True)
            async for chunk in chunks:
                parts.extend(c.delta.content or "" for c in chunk.choices)

        try:
            replies = await asyncio.gather(
                ask(prefill_prompt(rt, faulty.poison)),  # fails on its prompt (prefill)
                victim_stream(),  # fails at its token `at + 1`, mid-stream
                *(ask(content) for content in NEIGHBOURS),
                stream(NEIGHBOURS[0]),
                return_exceptions=True)
        finally:
            await client.close()
        return replies, parts

    replies, victim_parts = asyncio.run(go())
    prefill, mid_stream, *neighbours = replies
    assert isinstance(prefill, openai.InternalServerError), prefill
    assert prefill.code == "model_error" and "not a number" in prefill.message
    assert prefill.response.headers["x-should-retry"] == "false"
    assert isinstance(mid_stream, openai.APIError) and mid_stream.code == "model_error"
    assert "".join(victim_parts), "the victim streamed its first tokens before the fault"
    for reply in neighbours[:-1]:
        assert isinstance(reply, openai.types.chat.ChatCompletion), reply
        assert reply.usage is not None and reply.usage.completion_tokens > 0
    assert isinstance(neighbours[-1], list) and "".join(neighbours[-1])
    # Seven requests, seven admissions: nothing was sent twice, nothing set aside.
    admitted = [rid for batch in faulty.worker.admitted for rid in batch]
    assert len(admitted) == len(set(admitted)) == 3 + len(NEIGHBOURS)
    rds = sync_client(settings.REDIS_URL)
    assert rds.xlen(q.dead_key("faulty")) == 0
    # The same worker serves the next request.
    assert faulty.thread.is_alive()
    reply = openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0).chat \
        .completions.create(model="faulty", messages=[{"role": "user", "content": "again"}],
                            max_tokens=3, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens > 0


def test_over_grpc_the_fault_tells_a_retry_policy_not_to_retry(
        live: Live, faulty: Faulty, grpc_target: str) -> None:
    """A client whose retry policy retries INTERNAL (model_error's status) sends the
    call once: the trailing `grpc-retry-pushback-ms: -1` says not to (gRFC A6), as
    `x-should-retry: false` tells the OpenAI SDKs over REST."""
    key = make_org("bob", [Role.DEVELOPER]).keys[Role.DEVELOPER]
    rt = faulty.worker.runtime
    assert isinstance(rt, CausalLMRuntime)
    config = json.dumps({"methodConfig": [{
        "name": [{"service": "sluice.v1.Inference"}],
        "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.1s",
                        "backoffMultiplier": 1, "retryableStatusCodes": ["INTERNAL"]}}]})

    async def go() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(grpc_target, options=[
                ("grpc.enable_retries", 1), ("grpc.service_config", config)]) as channel:
            stub = pb_grpc.InferenceStub(channel)
            request = pb.ChatRequest(model="faulty", max_tokens=TOKENS, temperature=0,
                                     messages=[pb.ChatMessage(
                                         role="user", content=prefill_prompt(rt, faulty.poison))])
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Chat(request, metadata=(("authorization", f"Bearer {key}"),),
                                timeout=30)
            return caught.value

    error = asyncio.run(go())
    assert error.code() == grpc.StatusCode.INTERNAL, error
    trailing = dict(error.trailing_metadata() or ())
    assert trailing["error-code"] == "model_error"
    assert trailing["grpc-retry-pushback-ms"] == "-1"
    admitted = [rid for batch in faulty.worker.admitted for rid in batch]
    assert len(admitted) == 1, f"the call reached the worker {len(admitted)} times"
