"""logprobs and top_logprobs through the openai SDK (JSON and SSE), gRPC (unary and
streamed) and the WebSocket, and the refusals: every completion token has its entry,
in order, the same whichever way the reply travelled, and a greedy token is its own top
choice."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import openai
import pytest
import websockets

from streaming.protos import inference_pb2 as pb
from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live
from tests.streaming.test_grpc import call, chat

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Tell me about rivers."}]
TOKENS = 8


@pytest.fixture
def key(live: Live) -> str:
    return make_org("lp", [Role.DEVELOPER]).keys[Role.DEVELOPER]


def plain(entries: list[Any]) -> list[tuple[str, float, bytes, list[tuple[str, float]]]]:
    """SDK objects or gRPC messages as comparable tuples."""
    out = []
    for e in entries:
        raw = bytes(e.bytes) if hasattr(e, "bytes") and e.bytes is not None \
            else bytes(e.token_bytes)
        out.append((e.token, e.logprob, raw, [(t.token, t.logprob) for t in e.top_logprobs]))
    return out


def same(got: list[Any], want: list[Any]) -> bool:
    """The same tokens and bytes, and log probabilities within 1e-3: each call after the
    first reuses its prompt's blocks from the prefix cache, whose keys and values were
    computed in another batch shape (the last bits of a float may differ)."""
    def close(a: Any, b: Any) -> bool:
        if isinstance(a, float) and isinstance(b, float):
            return abs(a - b) <= 1e-3
        if isinstance(a, list | tuple) and isinstance(b, list | tuple):
            return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
        return bool(a == b)

    return close(got, want)


def test_every_token_has_its_logprob_whichever_way_the_reply_travels(
        live: Live, tiny: str, key: str, grpc_target: str) -> None:
    client = openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=30)
    reply = client.chat.completions.create(model=tiny, messages=ASK, max_tokens=TOKENS,
                                           temperature=0, logprobs=True, top_logprobs=2)
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert reply.usage is not None and len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and math.isfinite(entry.logprob)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        # Greedy: the token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    # The tokens' bytes make the reply (less a character cut at the end, if any).
    joined = b"".join(bytes(e.bytes or []) for e in content).decode("utf-8", "ignore")
    assert joined.startswith(choice.message.content.rstrip("\ufffd"))

    streamed: list[Any] = []
    text = ""
    for chunk in client.chat.completions.create(model=tiny, messages=ASK, max_tokens=TOKENS,
                                                temperature=0, logprobs=True, top_logprobs=2,
                                                stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                streamed += c.logprobs.content
    assert text == choice.message.content
    assert same(plain(streamed), plain(content))

    over_grpc = call(grpc_target, "Chat", chat(ASK[0]["content"], model=tiny,
                                                max_tokens=TOKENS, temperature=0,
                                                logprobs=True, top_logprobs=2), key=key)
    assert isinstance(over_grpc, pb.ChatResponse)
    assert same(plain(over_grpc.logprobs), plain(content))
    chunks = call(grpc_target, "ChatStream", chat(ASK[0]["content"], model=tiny,
                                                  max_tokens=TOKENS, temperature=0,
                                                  logprobs=True), key=key)
    grpc_streamed = [e for c in chunks for e in c.logprobs]
    assert same([(e.token, e.logprob) for e in grpc_streamed],
                [(t, lp) for t, lp, _b, _top in plain(content)])
    assert all(not e.top_logprobs for e in grpc_streamed)  # top_logprobs not asked

    async def over_websocket() -> list[dict[str, Any]]:
        url = live.base_url.replace("http://", "ws://") + "/chat/socket"
        async with websockets.connect(url, additional_headers={
                "Authorization": f"Bearer {key}"}) as ws:
            await ws.send(json.dumps({"type": "chat.request", "id": "r", "request": {
                "model": tiny, "messages": ASK, "max_tokens": TOKENS, "temperature": 0,
                "logprobs": True, "top_logprobs": 2}}))
            frames = []
            while not frames or frames[-1]["type"] not in ("chat.done", "error"):
                frames.append(json.loads(await asyncio.wait_for(ws.recv(), 20)))
            return frames

    frames = asyncio.run(over_websocket())
    over_ws = [e for f in frames if f["type"] == "chat.delta" for e in f["logprobs"]]
    assert same([(e["token"], e["logprob"], bytes(e["bytes"]),
                  [(t["token"], t["logprob"]) for t in e["top_logprobs"]]) for e in over_ws],
                plain(content))


def test_without_logprobs_there_are_none_and_top_alone_is_refused(
        live: Live, tiny: str, key: str) -> None:
    client = openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=30)
    reply = client.chat.completions.create(model=tiny, messages=ASK, max_tokens=3)
    assert reply.choices[0].logprobs is None
    for chunk in client.chat.completions.create(model=tiny, messages=ASK, max_tokens=3,
                                                stream=True):
        assert all(c.logprobs is None for c in chunk.choices)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=tiny, messages=ASK, max_tokens=3,
                                       top_logprobs=2)
    assert caught.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=tiny, messages=ASK, max_tokens=3,
                                       logprobs=True, top_logprobs=21)
    assert caught.value.code == "invalid_value"
