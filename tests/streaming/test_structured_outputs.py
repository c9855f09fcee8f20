"""Structured outputs (`response_format` with a JSON schema) through the openai SDK and
gRPC. The chat model here has random weights, so every valid reply is the constrained
decoder's doing, not the model's."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import grpc
import jsonschema
import openai
import pytest
import websockets
from google.protobuf.struct_pb2 import Struct
from pydantic import BaseModel

from streaming.protos import inference_pb2 as pb
from streaming.protos import inference_pb2_grpc as pb_grpc
from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live

pytestmark = pytest.mark.slow


class Weather(BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]
    days: int
    temperature: float
    sunny: bool


ASK = [{"role": "user", "content": "The weather in Paris, as JSON."}]
SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 30},
    "confidence": {"type": "number"},
    "tags": {"type": "object", "properties": {"lang": {"enum": ["en", "fr", None]}},
             "required": ["lang"], "additionalProperties": False}},
    "required": ["answer", "confidence", "tags"], "additionalProperties": False}


class Item(BaseModel):
    name: str
    quantity: int
    price: float


class Order(BaseModel):
    """A nested pydantic model: a list of objects and an optional field ($defs, anyOf)."""

    items: list[Item]
    note: str | None
    priority: Literal["low", "high"]


def json_schema(schema: dict[str, Any], name: str = "reply", *,
                strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": strict}}



@pytest.fixture
def tiny(roomy: str) -> str:
    """The toy model with room for the tool prompt and a whole call (1,024 tokens)."""
    return roomy

@pytest.fixture
def key(live: Live) -> str:
    return make_org("alice", [Role.DEVELOPER]).keys[Role.DEVELOPER]


@pytest.fixture
def client(live: Live, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=60)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sdks_parse_gets_an_instance_of_its_model(
        client: openai.OpenAI, tiny: str, temperature: float) -> None:
    for seed in range(3):
        reply = client.chat.completions.parse(model=tiny, messages=ASK, response_format=Weather,
                                              temperature=temperature, seed=seed,
                                              max_tokens=200)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Weather), choice.message.content
        assert reply.usage is not None and reply.usage.completion_tokens > 0


def test_a_streamed_reply_is_the_json_value_and_nothing_after_it(
        client: openai.OpenAI, tiny: str) -> None:
    parts, finish = [], None
    for chunk in client.chat.completions.create(
            model=tiny, messages=ASK, response_format=json_schema(SCHEMA), stream=True,
            temperature=1.0, seed=7, max_tokens=200):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)  # the whole text, no trailer
    assert len(parts) > 3, "streamed token by token"


def test_over_the_websocket(live: Live, key: str, tiny: str) -> None:
    async def go() -> list[dict[str, Any]]:
        url = live.base_url.replace("http://", "ws://") + "/chat/socket"
        async with websockets.connect(url, additional_headers={
                "Authorization": f"Bearer {key}"}) as ws:
            await ws.send(json.dumps({"type": "chat.request", "id": "r", "request": {
                "model": tiny, "messages": ASK, "temperature": 1.0, "seed": 5,
                "max_tokens": 200, "response_format": json_schema(SCHEMA)}}))
            frames = []
            while not frames or frames[-1]["type"] not in ("chat.done", "error"):
                frames.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            return frames

    frames = asyncio.run(go())
    assert frames[-1]["type"] == "chat.done" and frames[-1]["finish_reason"] == "stop", frames[-1]
    text = "".join(f.get("delta", "") for f in frames if f["type"] == "chat.delta")
    jsonschema.validate(json.loads(text), SCHEMA)


def test_nested_pydantic_models_parse(client: openai.OpenAI, tiny: str) -> None:
    for seed in range(3):
        reply = client.chat.completions.parse(model=tiny, messages=ASK, response_format=Order,
                                              temperature=1.0, seed=seed, max_tokens=200)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Order), choice.message.content


def test_json_object_is_always_a_json_object(client: openai.OpenAI, tiny: str) -> None:
    for seed in range(3):
        reply = client.chat.completions.create(
            model=tiny, messages=ASK, response_format={"type": "json_object"},
            temperature=1.0, seed=seed, max_tokens=200)
        assert reply.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


def test_tools_and_a_format_together_give_a_call_or_the_answer(
        client: openai.OpenAI, tiny: str) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 10}},
        "required": ["q"]}}}
    kinds = set()
    for seed in range(6):
        reply = client.chat.completions.create(
            model=tiny, messages=ASK, response_format=json_schema(SCHEMA), tools=[tool],
            temperature=1.0, seed=seed, max_tokens=200)
        choice = reply.choices[0]
        if choice.finish_reason == "tool_calls":
            kinds.add("call")
            for call in choice.message.tool_calls or []:
                assert call.function.name == "lookup"
                assert len(json.loads(call.function.arguments)["q"]) <= 10
        else:
            kinds.add("answer")
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    assert kinds, "every reply was one of the two"


def test_what_cannot_be_honoured_is_a_clear_400(client: openai.OpenAI, tiny: str) -> None:
    def refused(**kw: Any) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=kw.pop("model", tiny), messages=ASK, **kw)
        return caught.value

    negation = refused(response_format=json_schema(
        {"type": "object", "properties": {"xs": {"not": {"type": "string"}}}}, strict=False))
    assert negation.code == "invalid_response_format" and "not" in negation.message
    assert negation.param == "response_format.json_schema.schema"
    count = refused(response_format=json_schema({"type": "string", "maxLength": "20"}))
    assert count.code == "invalid_response_format"
    strict = refused(response_format=json_schema(
        {"type": "object", "properties": {"a": {"type": "string"}}}))
    assert "additionalProperties" in strict.message
    missing = refused(response_format={"type": "json_schema"})
    assert missing.code == "missing_required_parameter"
    echo = refused(model="echo", response_format=json_schema(SCHEMA))
    assert echo.code == "response_format_not_supported"
    # Plain text stays plain text.
    text = client.chat.completions.create(model="echo", messages=ASK,
                                          response_format={"type": "text"})
    assert text.choices[0].message.content == ASK[0]["content"]


def test_over_grpc(grpc_target: str, key: str, tiny: str) -> None:
    schema = Struct()
    schema.update(SCHEMA)

    async def go() -> Any:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            return await pb_grpc.InferenceStub(channel).Chat(pb.ChatRequest(
                model=tiny, messages=[pb.ChatMessage(role="user", content=ASK[0]["content"])],
                temperature=1.0, seed=3, max_tokens=200,
                response_format=pb.ResponseFormat(type="json_schema", json_schema=pb.JsonSchema(
                    name="reply", schema=schema, strict=True))),
                metadata=(("authorization", f"Bearer {key}"),), timeout=60)

    reply = asyncio.run(go())
    assert reply.finish_reason == "stop"
    jsonschema.validate(json.loads(reply.message.content), SCHEMA)
