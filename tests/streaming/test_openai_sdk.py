"""The official openai SDK, unchanged, against a live Sluice."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import openai
import pytest
import redis
from django.conf import settings

from inference import queue as q
from inference.client import InferenceClient
from inference.models import Deployment
from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live

pytestmark = pytest.mark.slow


@pytest.fixture
def keys(live: Live) -> dict[Role, str]:
    return make_org("alice", [Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR]).keys


def sdk(live: Live, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=30)


def test_chat_completion(live: Live, keys: dict[Role, str]) -> None:
    client = sdk(live, keys[Role.DEVELOPER])
    reply = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "Hello, Sluice! ünïcödé"}])
    assert reply.object == "chat.completion" and reply.model == "echo"
    assert reply.choices[0].message.content == "Hello, Sluice! ünïcödé"
    assert reply.choices[0].finish_reason == "stop"
    size = len("Hello, Sluice! ünïcödé".encode())
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (size, size)


def test_streaming_chunks_reassemble_with_usage(live: Live, keys: dict[Role, str]) -> None:
    client = sdk(live, keys[Role.DEVELOPER])
    text = "stream me " * 20
    stream = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": text}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(text)
    assert len(chunks) > 5, "tokens arrive as they are produced, not in one piece"


def test_max_tokens_truncates_with_length(live: Live, keys: dict[Role, str]) -> None:
    reply = sdk(live, keys[Role.DEVELOPER]).chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "abcdefghij"}], max_tokens=4)
    assert reply.choices[0].message.content == "abcd"
    assert reply.choices[0].finish_reason == "length"


def test_async_client(live: Live, keys: dict[Role, str]) -> None:
    async def go() -> list[str]:
        client = openai.AsyncOpenAI(base_url=live.base_url, api_key=keys[Role.DEVELOPER],
                                    max_retries=0)
        replies = await asyncio.gather(*[
            client.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": f"async {i}"}])
            for i in range(10)])
        await client.close()
        return [r.choices[0].message.content or "" for r in replies]

    assert asyncio.run(go()) == [f"async {i}" for i in range(10)]


def test_embeddings(live: Live, keys: dict[Role, str]) -> None:
    client = sdk(live, keys[Role.DEVELOPER])
    result = client.embeddings.create(model="minilm", input=[
        "A cat sits on the mat.", "A kitten rests on a rug.", "Corporate tax deadlines."])
    vectors = np.array([d.embedding for d in result.data])
    assert vectors.shape == (3, 384)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]
    assert result.usage.prompt_tokens > 10
    floats = client.embeddings.create(model="minilm", input="one", encoding_format="float")
    assert np.allclose(floats.data[0].embedding, client.embeddings.create(
        model="minilm", input="one").data[0].embedding, atol=1e-6)


def test_model_list(live: Live, keys: dict[Role, str]) -> None:
    ids = {m.id for m in sdk(live, keys[Role.DEVELOPER]).models.list()}
    assert ids == {"echo", "slow-echo", "minilm", "idle"}
    assert sdk(live, keys[Role.DEVELOPER]).models.retrieve("echo").id == "echo"


def test_error_types(live: Live, keys: dict[Role, str]) -> None:
    dev = sdk(live, keys[Role.DEVELOPER])
    hello = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError):
        sdk(live, "sk-sluice-aaaaaaaaaa-wrong").chat.completions.create(model="echo",
                                                                       messages=hello)
    with pytest.raises(openai.NotFoundError) as missing:
        dev.chat.completions.create(model="no-such-model", messages=hello)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        dev.chat.completions.create(model="echo", messages=[])
    with pytest.raises(openai.BadRequestError):
        dev.chat.completions.create(model="echo", messages=hello, max_tokens=10_000_000)
    with pytest.raises(openai.BadRequestError):
        dev.chat.completions.create(model="minilm", messages=hello)
    with pytest.raises(openai.BadRequestError) as unknown:
        dev.chat.completions.create(model="echo", messages=hello, extra_body={"colour": 1})
    assert "colour" in str(unknown.value)
    with pytest.raises(openai.PermissionDeniedError):
        sdk(live, keys[Role.AUDITOR]).chat.completions.create(model="echo", messages=hello)


def test_full_queue_is_a_rate_limit_error(live: Live, keys: dict[Role, str]) -> None:
    spec = Deployment.objects.get(name="idle").to_spec()

    async def fill() -> None:  # one queued request is this tenant's whole share
        client = InferenceClient(settings.REDIS_URL)
        await client.submit(spec, tenant="alice", body={"messages": []}, timeout_s=5)
        await client.close()

    asyncio.run(fill())
    with pytest.raises(openai.RateLimitError) as limited:
        sdk(live, keys[Role.DEVELOPER]).chat.completions.create(
            model="idle", messages=[{"role": "user", "content": "hi"}])
    assert limited.value.response.headers["retry-after"]


def test_client_disconnect_cancels_generation(live: Live, keys: dict[Role, str]) -> None:
    client = sdk(live, keys[Role.DEVELOPER])
    stream = client.chat.completions.create(
        model="slow-echo", messages=[{"role": "user", "content": "x" * 300}], stream=True)
    received = 0
    for chunk in stream:
        received += len(chunk.choices[0].delta.content or "") if chunk.choices else 0
        if received >= 3:
            break
    stream.close()
    worker = live.workers["slow-echo"]
    deadline = time.monotonic() + 5
    while worker.active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not worker.active, "generation stopped when the client left"
    rds = redis.Redis.from_url(settings.REDIS_URL)
    finals = [f[b"e"] for key in rds.scan_iter("sluice:{alice}:out:*")
              for _i, f in rds.xrange(key) if b'"done"' in f[b"e"]]
    assert any(b'"cancelled"' in e for e in finals)
    assert int(rds.get(q.depth_key("slow-echo")) or 0) == 0


def test_bad_input_is_a_clear_4xx_and_queues_nothing(live: Live, keys: dict[Role, str]) -> None:
    import httpx

    url = f"{live.base_url}/chat/completions"
    auth = {"Authorization": f"Bearer {keys[Role.DEVELOPER]}"}
    cases = [
        ({"model": "echo", "messages": "hi"}, 400),
        ({"model": "echo", "messages": [{"role": "wizard", "content": "x"}]}, 400),
        ({"model": 7, "messages": [{"role": "user", "content": "x"}]}, 400),
        ({"model": "echo", "messages": [{"role": "user", "content": "x"}], "n": 3}, 400),
        ({"model": "echo", "messages": [{"role": "user", "content": "x"}],
          "temperature": "hot"}, 400),
        ({"messages": [{"role": "user", "content": "x"}]}, 400),
    ]
    with httpx.Client(timeout=30) as http:
        for body, status in cases:
            response = http.post(url, json=body, headers=auth)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        huge = {"model": "echo", "messages": [{"role": "user", "content": "x" * 10_000_000}]}
        too_big = http.post(url, json=huge, headers=auth)
        assert too_big.status_code == 413
        assert http.post(url, content=b"{nope", headers=auth).status_code == 400
        assert http.get(url, headers=auth).status_code == 400
        assert http.post(url, json={"model": "echo"}).status_code == 401
    rds = redis.Redis.from_url(settings.REDIS_URL)
    assert not list(rds.scan_iter("sluice:{alice}:out:*")), "nothing reached a worker"
