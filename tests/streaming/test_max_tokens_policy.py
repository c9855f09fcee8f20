"""A max_tokens beyond what a deployment can produce (streaming/pipeline/max_tokens_policy.py),
against a live server through the official openai and anthropic SDKs and gRPC: refused
(the default, 400 max_tokens_too_large) or, with the clamp policy of the deployment or
of the alias called, lowered to what the deployment can produce, the reply saying so in
x-sluice-max-tokens-clamped on every API, streamed or not, in gRPC trailing metadata and
in the WebSocket's chat.done; and /v1/models entries carrying each model's limits."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import grpc
import openai
import pytest
import websockets

from inference import cache as registry_cache
from inference import selectors
from inference.models import AliasTarget, Deployment, ModelAlias
from streaming.pipeline.max_tokens_policy import CLAMPED_HEADER
from streaming.protos import inference_pb2 as pb
from streaming.protos import inference_pb2_grpc as pb_grpc
from tenants.roles import Role
from tests.conftest import Org, assert_openai_error, make_org
from tests.streaming.conftest import Live

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "hi"}]
CLAUDE_CODE_MAX = 32_000  # what Claude Code asks for by default
# The echo deployment's context (2,048) less the lower bound of "hi"'s tokens (1).
CLAMPED = "2047"


@pytest.fixture
def key(live: Live) -> str:
    return make_org("alice", [Role.DEVELOPER]).keys[Role.DEVELOPER]


@pytest.fixture
def oa(live: Live, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=60)


@pytest.fixture
def an(live: Live, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.base_url.removesuffix("/v1"), api_key=key,
                               max_retries=0, timeout=60)


def _policy(deployment: str, policy: str, **fields: Any) -> None:
    Deployment.objects.filter(name=deployment).update(max_tokens_policy=policy, **fields)
    registry_cache.clear()


def _alias(name: str, policy: str, *targets: str) -> None:
    alias = ModelAlias.objects.create(name=name, max_tokens_policy=policy)
    for target in targets:
        AliasTarget.objects.create(alias=alias, deployment=Deployment.objects.get(name=target))
    selectors.clear_routes()


def test_refuse_is_the_default_and_keeps_the_apis_400(oa: openai.OpenAI,
                                                      an: anthropic.Anthropic) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oa.chat.completions.create(model="echo", messages=ASK,  # type: ignore[arg-type]
                                   max_tokens=CLAUDE_CODE_MAX)
    assert caught.value.code == "max_tokens_too_large"
    with pytest.raises(anthropic.BadRequestError) as refused:
        an.messages.create(model="echo", messages=ASK,  # type: ignore[arg-type]
                           max_tokens=CLAUDE_CODE_MAX)
    assert "max_tokens" in str(refused.value)
    # A ceiling refuses past it, under the context too.
    _policy("echo", "refuse", max_output_tokens=64)
    with pytest.raises(openai.BadRequestError) as ceiling:
        oa.chat.completions.create(model="echo", messages=ASK,  # type: ignore[arg-type]
                                   max_tokens=65)
    assert ceiling.value.code == "max_tokens_too_large"


def test_clamp_lowers_max_tokens_and_says_so_on_every_api(
        oa: openai.OpenAI, an: anthropic.Anthropic) -> None:
    # Given a deployment that clamps
    _policy("echo", "clamp")
    # When Claude Code's default max_tokens comes on each API, streamed and not
    chat = oa.chat.completions.with_raw_response.create(
        model="echo", messages=ASK, max_tokens=CLAUDE_CODE_MAX)  # type: ignore[arg-type]
    # Then each call goes through, its reply saying what max_tokens it ran with
    assert chat.headers[CLAMPED_HEADER] == CLAMPED
    assert chat.parse().choices[0].message.content == "hi"
    with oa.chat.completions.with_streaming_response.create(
            model="echo", messages=ASK, max_completion_tokens=CLAUDE_CODE_MAX,  # type: ignore[arg-type]
            stream=True) as streamed:
        assert streamed.headers[CLAMPED_HEADER] == CLAMPED
        chunks: list[Any] = list(streamed.parse())
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hi"

    legacy = oa.completions.with_raw_response.create(model="echo", prompt="hi",
                                                     max_tokens=CLAUDE_CODE_MAX)
    assert legacy.headers[CLAMPED_HEADER] == CLAMPED and legacy.parse().choices[0].text
    with oa.completions.with_streaming_response.create(
            model="echo", prompt="hi", max_tokens=CLAUDE_CODE_MAX, stream=True) as streamed:
        assert streamed.headers[CLAMPED_HEADER] == CLAMPED
        assert list(streamed.parse())

    responses = oa.responses.with_raw_response.create(model="echo", input="hi",
                                                      max_output_tokens=CLAUDE_CODE_MAX)
    assert responses.headers[CLAMPED_HEADER] == CLAMPED
    assert responses.parse().output_text == "hi"
    with oa.responses.with_streaming_response.create(
            model="echo", input="hi", max_output_tokens=CLAUDE_CODE_MAX,
            stream=True) as streamed:
        assert streamed.headers[CLAMPED_HEADER] == CLAMPED
        assert [e.type for e in streamed.parse()][-1] == "response.completed"

    message = an.messages.with_raw_response.create(
        model="echo", messages=ASK, max_tokens=CLAUDE_CODE_MAX)  # type: ignore[arg-type]
    assert message.headers[CLAMPED_HEADER] == CLAMPED
    assert message.parse().content[0].text == "hi"  # type: ignore[union-attr]
    with an.messages.with_streaming_response.create(
            model="echo", messages=ASK, max_tokens=CLAUDE_CODE_MAX,  # type: ignore[arg-type]
            stream=True) as streamed:
        assert streamed.headers[CLAMPED_HEADER] == CLAMPED
        events: list[Any] = list(streamed.parse())
        assert events[-1].type == "message_stop"

    # A max_tokens that fits is left alone, without the header.
    fits = oa.chat.completions.with_raw_response.create(
        model="echo", messages=ASK, max_tokens=16)  # type: ignore[arg-type]
    assert CLAMPED_HEADER not in fits.headers


def test_clamp_stops_at_the_output_ceiling(oa: openai.OpenAI) -> None:
    _policy("echo", "clamp", max_output_tokens=64)
    reply = oa.chat.completions.with_raw_response.create(
        model="echo", messages=ASK, max_tokens=CLAUDE_CODE_MAX)  # type: ignore[arg-type]
    assert reply.headers[CLAMPED_HEADER] == "64"


def test_clamp_over_grpc_and_the_websocket(live: Live, grpc_target: str, key: str) -> None:
    _policy("echo", "clamp")
    auth = (("authorization", f"Bearer {key}"),)
    request = pb.ChatRequest(model="echo", messages=[pb.ChatMessage(role="user", content="hi")],
                             max_tokens=CLAUDE_CODE_MAX)

    async def over_grpc() -> tuple[Any, Any, str]:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            unary = stub.Chat(request, metadata=auth, timeout=60)
            reply = await unary
            stream = stub.ChatStream(request, metadata=auth, timeout=60)
            text = "".join([chunk.delta async for chunk in stream])
            return (dict(await unary.trailing_metadata()),
                    dict(await stream.trailing_metadata()), reply.message.content + text)

    unary, streamed, text = asyncio.run(over_grpc())
    assert unary[CLAMPED_HEADER] == CLAMPED and streamed[CLAMPED_HEADER] == CLAMPED
    assert text == "hihi"

    async def over_socket() -> dict[str, Any]:
        url = live.base_url.replace("http://", "ws://") + "/chat/socket"
        async with websockets.connect(url, additional_headers={
                "Authorization": f"Bearer {key}"}) as ws:
            await ws.send(json.dumps({"type": "chat.request", "id": "r", "request": {
                "model": "echo", "messages": ASK, "max_tokens": CLAUDE_CODE_MAX}}))
            while True:
                frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if frame["type"] != "chat.delta":
                    return frame

    done = asyncio.run(over_socket())
    assert done["type"] == "chat.done" and done["max_tokens_clamped"] == int(CLAMPED), done


def test_an_alias_that_clamps_clamps_on_its_deployments(oa: openai.OpenAI) -> None:
    # Given two aliases over the same refusing deployment, one of which clamps
    _alias("org/clamped", "clamp", "echo")
    _alias("org/strict", "refuse", "echo")
    # When Claude Code's max_tokens comes to each
    reply = oa.chat.completions.with_raw_response.create(
        model="org/clamped", messages=ASK, max_tokens=CLAUDE_CODE_MAX)  # type: ignore[arg-type]
    # Then the clamping alias's call goes through, lowered; the other's is refused
    assert reply.headers[CLAMPED_HEADER] == CLAMPED
    assert reply.parse().choices[0].message.content == "hi"
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(model="org/strict", messages=ASK,  # type: ignore[arg-type]
                                   max_tokens=CLAUDE_CODE_MAX)
    # And a deployment's own clamp applies through an alias that does not
    _policy("echo", "clamp")
    selectors.clear_routes()
    through = oa.chat.completions.with_raw_response.create(
        model="org/strict", messages=ASK, max_tokens=CLAUDE_CODE_MAX)  # type: ignore[arg-type]
    assert through.headers[CLAMPED_HEADER] == CLAMPED


def test_models_carry_their_limits(oa: openai.OpenAI, grpc_target: str, key: str) -> None:
    _policy("echo", "refuse", max_output_tokens=512)
    _alias("org/both", "refuse", "echo", "slow-echo")
    Deployment.objects.filter(name="slow-echo").update(max_context=1024)
    models = {m.id: m for m in oa.models.list()}
    assert (models["echo"].context_window, models["echo"].max_output_tokens) == (2048, 512)  # type: ignore[attr-defined]
    assert (models["slow-echo"].context_window,  # type: ignore[attr-defined]
            models["slow-echo"].max_output_tokens) == (1024, 1023)  # type: ignore[attr-defined]
    # An alias: the smallest of its deployments'.
    both = oa.models.retrieve("org/both")
    assert (both.context_window, both.max_output_tokens) == (1024, 512)  # type: ignore[attr-defined]

    async def listed() -> dict[str, Any]:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            reply = await pb_grpc.InferenceStub(channel).ListModels(
                pb.ListModelsRequest(), metadata=(("authorization", f"Bearer {key}"),),
                timeout=30)
            return {m.id: (m.context_window, m.max_output_tokens) for m in reply.data}

    assert asyncio.run(listed())["echo"] == (2048, 512)


@pytest.mark.django_db
def test_an_unknown_policy_is_a_422_and_saves_nothing(ops: Org) -> None:
    pa = ops.client(Role.PLATFORM_ADMIN)
    made = pa.post("/api/v1/deployments", {"name": "e2", "runtime": "echo",
                                            "max_tokens_policy": "clamp"})
    assert made.status == 201 and made.body["max_tokens_policy"] == "clamp", made.body
    bad = pa.patch("/api/v1/deployments/e2", {"max_tokens_policy": "truncate",
                                              "max_context": 4096})
    assert_openai_error(bad, 422)
    row = Deployment.objects.get(name="e2")
    assert (row.max_tokens_policy, row.max_context) == ("clamp", 2048)
    refused = pa.post("/api/v1/deployments", {"name": "e3", "runtime": "echo",
                                               "max_tokens_policy": "CLAMP"})
    assert 400 <= refused.status < 500 and not Deployment.objects.filter(name="e3").exists()
    alias = pa.post("/api/v1/model-aliases", {"name": "a1", "targets": [{"deployment": "e2"}],
                                              "max_tokens_policy": "maybe"})
    assert 400 <= alias.status < 500 and not ModelAlias.objects.filter(name="a1").exists()
    ok = pa.post("/api/v1/model-aliases", {"name": "a1", "targets": [{"deployment": "e2"}],
                                           "max_tokens_policy": "clamp"})
    assert ok.status == 201 and ok.body["max_tokens_policy"] == "clamp", ok.body
    patched = pa.patch("/api/v1/model-aliases/a1", {"max_tokens_policy": "refuse"})
    assert patched.body["max_tokens_policy"] == "refuse"
