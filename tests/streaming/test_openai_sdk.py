"""The official openai SDK, unchanged, against a live Sluice."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
import openai
import pytest
from django.conf import settings

from inference import queue as q
from inference.client import InferenceClient
from inference.jobs import ChatJob
from inference.models import Deployment
from sluice.redis import sync_client
from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


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
        await client.submit(spec, tenant="alice", job=ChatJob(messages=[]), timeout_s=5)
        await client.close()

    asyncio.run(fill())
    with pytest.raises(openai.RateLimitError) as limited:
        sdk(live, keys[Role.DEVELOPER]).chat.completions.create(
            model="idle", messages=[{"role": "user", "content": "hi"}])
    assert limited.value.response.headers["retry-after"]


def test_client_disconnect_cancels_generation(live: Live, keys: dict[Role, str],
                                              settings: Any) -> None:
    settings.SLUICE_STREAM_RESUME_GRACE_S = 0.2  # (default 10 s, for reconnects)
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
    rds = sync_client(settings.REDIS_URL)
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
        ({"model": "echo", "messages": [{"role": "user", "content": "x"}], "n": 9}, 400),
        ({"model": "echo", "messages": [{"role": "user", "content": "x"}],
          "temperature": "hot"}, 400),
        ({"messages": [{"role": "user", "content": "x"}]}, 400),
        # A NUL in the model name reached a PostgreSQL lookup (a 500; Schemathesis).
        ({"model": "\u0000H", "messages": [{"role": "user", "content": "x"}]}, 400),
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
    rds = sync_client(settings.REDIS_URL)
    assert not list(rds.scan_iter("sluice:{alice}:out:*")), "nothing reached a worker"


def _sse(lines: list[str]) -> list[tuple[str, dict[str, Any] | str]]:
    """(id, data) pairs of an SSE body."""
    out, event_id = [], ""
    for line in lines:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
            out.append((event_id, data if data == "[DONE]" else json.loads(data)))
    return out


def _text(pairs: list[tuple[str, Any]]) -> str:
    return "".join(d["choices"][0]["delta"].get("content") or "" for _i, d in pairs
                   if isinstance(d, dict) and d.get("choices"))


def test_resume_after_dropped_connection_gives_identical_text(
        live: Live, keys: dict[Role, str]) -> None:
    """The reconnect gets the rest of the same generation from its stored events: the
    worker admitted the request once, and another tenant cannot attach to it."""
    import httpx

    body = {"model": "slow-echo", "stream": True,
            "messages": [{"role": "user", "content": "resume me please " * 3}]}
    auth = {"Authorization": f"Bearer {keys[Role.DEVELOPER]}"}
    url = f"{live.base_url}/chat/completions"
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", url, json=body, headers=auth) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["cache-control"] == "no-cache"
            assert response.headers["x-accel-buffering"] == "no"
            lines: list[str] = []
            for line in response.iter_lines():
                lines.append(line)
                if len([x for x in lines if x.startswith("data: ")]) >= 6:
                    break  # drop the connection mid-stream
        head = _sse(lines)
        last_id = head[-1][0]
        assert last_id.count(":") == 1
        rest_response = http.post(url, json=body, headers={**auth, "Last-Event-ID": last_id})
        assert rest_response.status_code == 200
        rest = _sse(rest_response.text.splitlines())
    assert rest[-1] == (rest[-1][0], "[DONE]")
    assert _text(head) + _text(rest) == "resume me please " * 3
    rid = last_id.split(":")[0]
    admitted = [r for batch in live.workers["slow-echo"].admitted for r in batch]
    assert admitted.count(rid) == 1, "generated once, not regenerated"
    with httpx.Client(timeout=30) as http:
        unknown = http.post(url, json=body, headers={**auth, "Last-Event-ID": "0abc:3"})
        bob = make_org("bob", [Role.DEVELOPER]).keys[Role.DEVELOPER]
        stolen = http.post(url, json=body, headers={"Authorization": f"Bearer {bob}",
                                                    "Last-Event-ID": last_id})
    assert unknown.status_code == 404
    assert stolen.status_code == 404, "a stream is only resumable by its own tenant"


def test_revoked_key_stops_working_on_the_hot_path_within_seconds(
        live: Live, keys: dict[Role, str]) -> None:
    import httpx

    dev = sdk(live, keys[Role.DEVELOPER])
    hello = [{"role": "user", "content": "hi"}]
    assert dev.chat.completions.create(model="echo", messages=hello)  # now cached
    admin = {"Authorization": f"Bearer {keys[Role.TENANT_ADMIN]}"}
    api = live.base_url.replace("/v1", "/api/v1")
    with httpx.Client(timeout=10) as http:
        key_id = http.get(f"{api}/me", headers={
            "Authorization": f"Bearer {keys[Role.DEVELOPER]}"}).json()["key_id"]
        assert http.delete(f"{api}/keys/{key_id}", headers=admin).status_code == 200
    revoked_at = time.monotonic()
    while True:
        try:
            dev.chat.completions.create(model="echo", messages=hello)
        except openai.AuthenticationError:
            break
        assert time.monotonic() - revoked_at < 3, "revocation must reach the cache quickly"
        time.sleep(0.1)


def test_silent_streams_get_keep_alive_comments(live: Live, keys: dict[Role, str],
                                                settings: Any) -> None:
    import threading

    import httpx

    from inference.worker import Worker

    settings.SLUICE_SSE_HEARTBEAT_S = 0.1
    spec = Deployment.objects.create(name="glacial", runtime="echo",
                                     echo_token_delay_ms=400).to_spec()
    worker = Worker(spec, sync_client(settings.REDIS_URL), block_ms=200)
    thread = threading.Thread(target=worker.run, kwargs={"drain_s": 1}, daemon=True)
    thread.start()
    try:
        with httpx.Client(timeout=30) as http:
            response = http.post(f"{live.base_url}/chat/completions", headers={
                "Authorization": f"Bearer {keys[Role.DEVELOPER]}"}, json={
                "model": "glacial", "stream": True,
                "messages": [{"role": "user", "content": "abc"}]})
    finally:
        worker.stopping.set()
        thread.join(10)
    lines = response.text.splitlines()
    assert lines.count(": keep-alive") >= 2
    assert _text(_sse(lines)) == "abc", "comments do not disturb the data"
    assert [line for line in lines if line][-1] == "data: [DONE]"
