"""One tenant's abuse of the shared gateway, on every API and transport, while another
tenant calls the same deployment: the abuse is refused cheaply with its own clear error
(what a structural pre-check cannot tell is compiled only after the call's admission,
inference/structured/grammar_check.py), and the other tenant's calls all succeed.
(The figures under load: tests/bench/bench_neighbours.py.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest
import websockets
from google.protobuf.struct_pb2 import Struct

from governance import audit
from governance import cache as policy_cache
from governance import live as live_state
from governance.models import AuditEvent, BreakerPolicy
from inference import cache as registry_cache
from inference.models import Deployment
from streaming.protos import inference_pb2 as pb
from streaming.protos import inference_pb2_grpc as pb_grpc
from tenants.roles import Role
from tests.conftest import eventually, make_org
from tests.streaming.conftest import Live

pytestmark = pytest.mark.slow

# The probe's 900-byte schema: an allOf of 30 search patterns on one string (18 of them
# stalled a gateway for 8.5 s; 26, a 4.4 GB allocation and a Rust abort).
BOMB = {"type": "object", "properties": {"x": {"type": "string", "allOf": [
    {"pattern": f".*{chr(97 + i % 26)}{i}.*"} for i in range(30)]}}, "required": ["x"]}
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture
def keys(live: Live) -> tuple[str, str]:
    """A developer's key of tenant A (the abuser) and of tenant B (the neighbour)."""
    return (make_org("alice", [Role.DEVELOPER]).keys[Role.DEVELOPER],
            make_org("bob", [Role.DEVELOPER]).keys[Role.DEVELOPER])


def neighbour_answered(live: Live, key: str) -> None:
    reply = openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0,
                          timeout=60).chat.completions.create(model="echo", messages=ASK)
    assert reply.choices[0].message.content == "hi"


def test_a_grammar_bomb_is_refused_on_every_api_and_the_neighbour_is_served(
        live: Live, tiny: str, keys: tuple[str, str]) -> None:
    abuser, neighbour = keys
    oa = openai.OpenAI(base_url=live.base_url, api_key=abuser, max_retries=0, timeout=60)
    an = anthropic.Anthropic(base_url=live.base_url.removesuffix("/v1"), api_key=abuser,
                             max_retries=0, timeout=60)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": BOMB}}
    tool = {"type": "function", "function": {"name": "f", "parameters": BOMB}}
    calls: list[Any] = [
        lambda: oa.chat.completions.create(model=tiny, messages=ASK, response_format=fmt),
        lambda: list(oa.chat.completions.create(model=tiny, messages=ASK, tools=[tool],
                                                stream=True)),
        lambda: oa.responses.create(model=tiny, input="hi", text={"format": {
            "type": "json_schema", "name": "x", "schema": BOMB}}),
        lambda: an.messages.create(model=tiny, max_tokens=10, messages=ASK,
                                   tools=[{"name": "f", "input_schema": BOMB}]),
        lambda: an.messages.count_tokens(model=tiny, messages=ASK,
                                         tools=[{"name": "f", "input_schema": BOMB}]),
    ]
    for call in calls:
        with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as caught:
            call()
        assert "intersects more than 8 patterns" in str(caught.value), caught.value
        if isinstance(caught.value, openai.BadRequestError):
            assert caught.value.code == "schema_too_complex"
        neighbour_answered(live, neighbour)
    # each refusal is audited as a refused call of tenant A
    def refusals() -> bool:
        audit.drain(settle_s=0.1)
        return AuditEvent.objects.filter(tenant__slug="alice",
                                         detail__code="schema_too_complex").count() >= len(calls)
    assert eventually(refusals, 30)


def test_a_grammar_bomb_over_grpc_and_the_websocket(
        live: Live, tiny: str, grpc_target: str, keys: tuple[str, str]) -> None:
    abuser, neighbour = keys
    schema = Struct()
    schema.update(BOMB)

    async def over_grpc() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await pb_grpc.InferenceStub(channel).Chat(pb.ChatRequest(
                    model=tiny, messages=[pb.ChatMessage(role="user", content="hi")],
                    response_format=pb.ResponseFormat(type="json_schema", json_schema=pb.JsonSchema(
                        name="x", schema=schema))),
                    metadata=(("authorization", f"Bearer {abuser}"),), timeout=60)
            return caught.value

    refused = asyncio.run(over_grpc())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "too complex" in (refused.details() or "")
    neighbour_answered(live, neighbour)

    async def over_socket() -> dict[str, Any]:
        url = live.base_url.replace("http://", "ws://") + "/chat/socket"
        async with websockets.connect(url, additional_headers={
                "Authorization": f"Bearer {abuser}"}) as ws:
            await ws.send(json.dumps({"type": "chat.request", "id": "r", "request": {
                "model": tiny, "messages": ASK, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "x", "schema": BOMB}}}}))
            frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 30))
            return frame

    frame = asyncio.run(over_socket())
    assert frame["type"] == "error" and frame["error"]["code"] == "schema_too_complex", frame
    neighbour_answered(live, neighbour)


def test_sixty_wide_tools_are_refused_by_their_size(live: Live, tiny: str,
                                                    keys: tuple[str, str]) -> None:
    abuser, neighbour = keys
    # 60 tools x 2,000 optional properties: ~3.4 MB, under the body limit
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                              for i in range(2000)}}
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": wide}}
             for i in range(60)]
    with pytest.raises(openai.BadRequestError) as caught:
        openai.OpenAI(base_url=live.base_url, api_key=abuser, max_retries=0,
                      timeout=60).chat.completions.create(model=tiny, messages=ASK,
                                                          tools=tools)  # type: ignore[arg-type]
    assert caught.value.code == "schema_too_complex"
    neighbour_answered(live, neighbour)


def test_a_prompt_no_tokenizer_could_fit_is_refused_untokenized(
        live: Live, tiny: str, keys: tuple[str, str]) -> None:
    abuser, neighbour = keys
    huge = "word " * 700_000  # 3.5 MB: more than 256 bytes a token over 256 tokens
    oa = openai.OpenAI(base_url=live.base_url, api_key=abuser, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        oa.chat.completions.create(model=tiny, messages=[{"role": "user", "content": huge}])
    assert caught.value.code == "context_length_exceeded"
    counted = httpx.post(f"{live.base_url}/messages/count_tokens", timeout=60, json={
        "model": tiny, "messages": [{"role": "user", "content": huge}]},
        headers={"x-api-key": abuser, "anthropic-version": "2023-06-01"})
    assert counted.status_code == 400, counted.text
    assert "context" in counted.json()["error"]["message"]
    neighbour_answered(live, neighbour)


def test_a_deployments_output_ceiling_refuses_longer_replies(live: Live,
                                                             keys: tuple[str, str]) -> None:
    abuser, _neighbour = keys
    Deployment.objects.filter(name="echo").update(max_output_tokens=64)
    registry_cache.clear()
    oa = openai.OpenAI(base_url=live.base_url, api_key=abuser, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        oa.chat.completions.create(model="echo", messages=ASK, max_tokens=1500)
    assert caught.value.code == "max_tokens_too_large"
    assert "at most 64 tokens" in caught.value.message
    reply = oa.chat.completions.create(model="echo", messages=ASK, max_tokens=64)
    assert reply.choices[0].message.content == "hi"


def test_short_grpc_deadlines_of_one_tenant_open_no_breaker(
        live: Live, grpc_target: str, keys: tuple[str, str]) -> None:
    """The probe's second abuse: gRPC calls whose client deadline ends mid-reply, on a
    breaker that opens after 5 failures in 10 calls. The caller's deadline is not the
    deployment's failure: the breaker stays closed and the neighbour is served."""
    abuser, neighbour = keys
    dep = Deployment.objects.get(name="slow-echo")
    policy, _ = BreakerPolicy.objects.update_or_create(deployment=dep, defaults={
        "min_calls": 5, "window_size": 10, "failure_rate": 0.5, "open_wait_s": 30})
    policy_cache.clear()

    async def deadlines() -> list[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            stub = pb_grpc.InferenceStub(channel)

            async def one() -> grpc.StatusCode:
                try:  # 50 ms a token: 200 tokens outlive a 0.3 s deadline
                    await stub.Chat(pb.ChatRequest(
                        model="slow-echo", max_tokens=200,
                        messages=[pb.ChatMessage(role="user", content="word " * 200)]),
                        metadata=(("authorization", f"Bearer {abuser}"),), timeout=0.3)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK
            return list(await asyncio.gather(*(one() for _ in range(20))))

    codes = asyncio.run(deadlines())
    assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) >= 10, codes

    def settled() -> bool:  # the calls' settlements (breaker outcomes, audit) written
        audit.drain(settle_s=0.1)
        return AuditEvent.objects.filter(tenant__slug="alice", model="slow-echo").count() >= 20
    assert eventually(settled, 30)
    snap = live_state.breaker_state(policy)
    assert snap["state"] == "closed" and snap["failures"] == 0, snap
    reply = openai.OpenAI(base_url=live.base_url, api_key=neighbour, max_retries=0,
                          timeout=60).chat.completions.create(
        model="slow-echo", messages=ASK, max_tokens=2)
    assert reply.choices[0].message.content
    assert live_state.breaker_state(policy)["state"] == "closed"
