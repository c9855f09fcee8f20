"""The Responses API (POST /v1/responses; GET / DELETE /v1/responses/{id}, input_items)
over the official clients (openai, openai-agents) against a live server. The "tiny"
chat model has random weights: what its replies prove is the pipeline's doing (prompt
sizes, constrained calls and formats), not the model's. Errors, access and personal data:
test_responses_access.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from governance import audit
from governance.models import AuditEvent
from sluice.redis import sync_redis
from streaming.apis.responses import writer as responses_writer
from streaming.apis.responses.copy import copy_key
from streaming.models import StoredResponse
from tenants.roles import Role
from tests.conftest import (
    Org,
    eventually,
    gateway_process,
    make_org,
    process_env,
)
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"type": "string",
                                                  "enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["item", "qty"],
         "properties": {"item": {"type": "string", "maxLength": 12},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("alice", [Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR])


def sdk(live: Live, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=60)


@pytest.fixture
def client(live: Live, org: Org) -> openai.OpenAI:
    return sdk(live, org.keys[Role.DEVELOPER])


# -- create ---------------------------------------------------------------------------------
def test_create_answers_a_response_the_sdk_parses(client: openai.OpenAI) -> None:
    # Given the echo model, When a developer creates a response from a string
    response = client.responses.create(model="echo", input="hello world!")
    # Then the SDK parses it, and output_text is the reply
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.model == "echo"
    assert response.output_text == "hello world!"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert response.usage is not None
    assert response.usage.input_tokens == len(b"hello world!")
    assert response.usage.output_tokens == len(b"hello world!")
    assert response.usage.total_tokens == 2 * len(b"hello world!")
    assert response.store is True and response.previous_response_id is None


def test_instructions_and_message_items_reach_the_model(client: openai.OpenAI,
                                                       tiny: str) -> None:
    # Given the same question under a short and a long instruction, as text and as items
    question = "What is the capital of France?"
    short = client.responses.create(model=tiny, instructions="Be terse.", input=question,
                                    max_output_tokens=4)
    long = client.responses.create(
        model=tiny, instructions="Be terse. " + "You are a patient geography tutor. " * 4,
        input=[{"role": "user", "content": [{"type": "input_text", "text": question}]}],
        max_output_tokens=4)
    # Then the instructions were part of each prompt, and are echoed back
    assert short.usage and long.usage
    assert long.usage.input_tokens > short.usage.input_tokens + 20
    assert short.instructions == "Be terse."
    assert short.usage.output_tokens <= 4


# -- streaming ------------------------------------------------------------------------------
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done",
               "response.output_item.done", "response.completed"]


def test_stream_sends_the_official_events_numbered_in_order(client: openai.OpenAI) -> None:
    # When a developer streams a response
    events = list(client.responses.create(model="echo", input="hello stream", stream=True))
    # Then the events come in OpenAI's order, numbered 0, 1, 2, ...
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2
    assert [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]] == TEXT_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(d.delta for d in deltas) == "hello stream"
    done = events[-1]
    assert done.type == "response.completed"
    assert done.response.output_text == "hello stream" and done.response.usage is not None
    assert {d.item_id for d in deltas} == {done.response.output[0].id}
    # and it was stored before it completed
    assert client.responses.retrieve(done.response.id).output_text == "hello stream"


def test_stream_helper_accumulates_the_final_response(client: openai.OpenAI) -> None:
    with client.responses.stream(model="echo", input="helper text") as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == "helper text" and final.output_text == "helper text"


def test_stream_that_reaches_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="echo", input="a long enough reply",
                                          max_output_tokens=5, stream=True))
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == "a lon"


def test_a_generation_that_fails_midway_ends_the_stream_failed(client: openai.OpenAI,
                                                              settings: Any) -> None:
    # Given a deadline (3 s) far shorter than the slow model's reply (200 tokens, 10 s)
    settings.SLUICE_REQUEST_TIMEOUT_S = 3
    # When the stream has begun and the deadline passes
    events = list(client.responses.create(model="slow-echo", input="x" * 200, stream=True))
    # Then the open message ends incomplete and the response failed, saying why
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed"
    assert last.response.error is not None and "deadline" in last.response.error.message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done and done[0].item.status == "incomplete"
    responses_writer.drain()
    assert StoredResponse.objects.get(public_id=last.response.id).status == "failed"


# -- stored responses -----------------------------------------------------------------------
def test_retrieve_input_items_and_delete(client: openai.OpenAI) -> None:
    # Given a stored response made from three input items
    created = client.responses.create(model="echo", metadata={"topic": "demo"}, input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "assistant", "content": "Ask me anything."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "first "}, {"type": "input_text", "text": "second"}]},
    ])
    assert created.output_text == "first second"
    # When it is retrieved, Then it is the same response
    got = client.responses.retrieve(created.id)
    assert got.id == created.id and got.output_text == created.output_text
    assert got.usage == created.usage and got.metadata == {"topic": "demo"}
    # and its input items list newest first, a page at a time
    page = client.responses.input_items.list(created.id, limit=2)
    assert [i.role for i in page.data] == ["user", "assistant"] and page.has_more
    everything = list(client.responses.input_items.list(created.id, limit=1))
    assert [i.role for i in everything] == ["user", "assistant", "developer"]
    ordered = client.responses.input_items.list(created.id, order="asc")
    assert [i.role for i in ordered.data] == ["developer", "assistant", "user"]
    assert [c.text for c in ordered.data[2].content] == ["first ", "second"]
    # When it is deleted, Then it is gone
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="echo", input="more", previous_response_id=created.id)


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    response = client.responses.create(model="echo", input="forget me", store=False)
    assert response.store is False and response.output_text == "forget me"
    assert not StoredResponse.objects.filter(public_id=response.id).exists()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_an_idempotency_key_answers_a_retry_with_the_first_response(
        client: openai.OpenAI) -> None:
    # Given a stored response made with an Idempotency-Key
    key = {"Idempotency-Key": "order-42"}
    first = client.responses.create(model="echo", input="charge me once", extra_headers=key)
    # When the same call is sent again with the key (a retry after a lost reply)
    again = client.responses.create(model="echo", input="charge me once", extra_headers=key)
    # Then it is the same response, stored once
    assert again.id == first.id and again.output_text == first.output_text
    responses_writer.drain()
    assert StoredResponse.objects.filter(public_id=first.id).count() == 1
    # and the key with another body is refused, not answered with the first reply
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.responses.create(model="echo", input="something else", extra_headers=key)
    assert refused.value.code == "idempotency_key_reused"


def test_previous_response_id_continues_the_chain(client: openai.OpenAI, tiny: str) -> None:
    # Given a first turn
    first = client.responses.create(model=tiny, input="My name is Ada.",
                                    max_output_tokens=8, temperature=0)
    # When the next turns continue it
    second = client.responses.create(model=tiny, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=8,
                                     temperature=0)
    third = client.responses.create(model=tiny, input="And again?",
                                    previous_response_id=second.id, max_output_tokens=8,
                                    temperature=0)
    alone = client.responses.create(model=tiny, input="What is my name?",
                                    max_output_tokens=8, temperature=0)
    # Then each prompt held the turns before it (their input and output)
    assert first.usage and second.usage and third.usage and alone.usage
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens >= \
        alone.usage.input_tokens + first.usage.output_tokens + 5
    assert third.usage.input_tokens > second.usage.input_tokens + 4
    # and a response's input items are its own
    assert [i.content[0].text for i in client.responses.input_items.list(second.id)] == \
        ["What is my name?"]


# -- tools and structured output ------------------------------------------------------------
def test_function_call_is_an_output_item_with_valid_arguments(client: openai.OpenAI,
                                                              roomy: str) -> None:
    response = client.responses.create(
        model=roomy, input="What's the weather in Paris?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"})
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert response.output_text == ""
    assert client.responses.retrieve(response.id) == response  # stored as answered
    # The call and its result go back as items: the next turn's prompt holds both
    follow = client.responses.create(model=roomy, previous_response_id=response.id,
                                     tools=[WEATHER], tool_choice="none", max_output_tokens=4,
                                     input=[{"type": "function_call_output",
                                             "call_id": call.call_id,
                                             "output": '{"temp_c": 18}'}])
    alone = client.responses.create(model=roomy, input="What's the weather in Paris?",
                                    max_output_tokens=4)
    assert follow.usage and alone.usage
    assert follow.usage.input_tokens > alone.usage.input_tokens + 10
    assert not [item for item in follow.output if item.type == "function_call"]


def test_streamed_function_call_sends_argument_events(client: openai.OpenAI,
                                                      roomy: str) -> None:
    events = list(client.responses.create(
        model=roomy, input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    # the arguments come in pieces, as the model writes them
    assert len(deltas) > 1
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(deltas),
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-3]
    assert done.type == "response.function_call_arguments.done"
    assert "".join(deltas) == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])
    [call] = events[-1].response.output
    assert call.type == "function_call" and call.arguments == done.arguments
    assert client.responses.retrieve(events[-1].response.id) == events[-1].response


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "name": "order", "schema": ORDER, "strict": True},
    {"type": "json_object"},
])
def test_text_format_constrains_the_reply(client: openai.OpenAI, tiny: str,
                                          fmt: dict[str, Any]) -> None:
    response = client.responses.create(model=tiny, input="Order something.",
                                       text={"format": fmt}, max_output_tokens=60)
    value = json.loads(response.output_text)
    if fmt["type"] == "json_schema":
        jsonschema.validate(value, ORDER)
        assert response.text and response.text.format and response.text.format.type == \
            "json_schema"
    else:
        assert isinstance(value, dict)


# -- the Agents SDK -------------------------------------------------------------------------
def test_agents_runner_calls_a_function_tool_and_gets_its_result_back(
        live: Live, org: Org, roomy: str) -> None:
    import agents
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)  # nothing outside is reachable
    calls: list[str] = []

    @agents.function_tool
    def get_time(zone: str) -> str:
        """The time in a zone."""
        calls.append(zone)
        return "It is 12:00 there."

    class Answer(pydantic.BaseModel):
        time: str = pydantic.Field(max_length=8)

    async def run() -> Any:
        openai_client = openai.AsyncOpenAI(base_url=live.base_url, max_retries=0, timeout=60,
                                           api_key=org.keys[Role.DEVELOPER])
        # The answer is structured: a model with random weights ends a JSON value within
        # its max_tokens (the grammar closes it), but rarely ends free text.
        agent = agents.Agent(
            name="clock", instructions="Tell the time.", tools=[get_time], output_type=Answer,
            model=OpenAIResponsesModel(model=roomy, openai_client=openai_client),
            model_settings=agents.ModelSettings(tool_choice="required", max_tokens=40,
                                                temperature=0, parallel_tool_calls=False))
        return await agents.Runner.run(agent, "What time is it in Paris?", max_turns=6)

    result = asyncio.run(run())
    # The first turn called the tool (required); the SDK then resets tool_choice to auto,
    # so a later turn may call it again (its prompt holds the call's random id: the
    # random-weights model's choice varies) before it answers. One call a turn, each
    # result back to the model as the next turn's input, and a structured answer.
    assert calls and isinstance(result.final_output, Answer)
    assert len(result.raw_responses) == len(calls) + 1
    second = result.raw_responses[1].response_id
    client = sdk(live, org.keys[Role.DEVELOPER])
    items = list(client.responses.input_items.list(second, order="asc"))
    outputs = [i for i in items if i.type == "function_call_output"]
    assert [o.output for o in outputs] == ["It is 12:00 there."]
    assert [i.name for i in items if i.type == "function_call"] == ["get_time"]


# -- across gateway processes and restarts ---------------------------------------------------
def test_previous_response_id_works_across_gateways_and_a_restart(live: Live, org: Org,
                                                                  tiny: str) -> None:
    env = process_env()
    key = org.keys[Role.DEVELOPER]

    def ask(base: str, text: str, previous: str | None = None) -> dict[str, Any]:
        reply = httpx.post(f"{base}/v1/responses", timeout=60,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": tiny, "input": text, "max_output_tokens": 4,
                                 "temperature": 0, "previous_response_id": previous})
        assert reply.status_code == 200, reply.text
        return reply.json()

    # Given a response made through one gateway process
    with gateway_process(env) as (_a, first_base):
        first = ask(first_base, "My name is Ada.")
        alone = ask(first_base, "What is my name?")
        # When another gateway process continues it, Then it finds it
        with gateway_process(env) as (_b, second_base):
            second = ask(second_base, "What is my name?", first["id"])
    # And after both stopped and the writer ran, a new one continues the chain from the
    # database (Redis no longer has a copy)
    assert responses_writer.drain() >= 3
    assert not any(sync_redis().exists(copy_key(org.tenant.pk, r["id"]))
                   for r in (first, second))
    with gateway_process(env) as (_c, third_base):
        third = ask(third_base, "Say it again.", second["id"])
        items = httpx.get(f"{third_base}/v1/responses/{third['id']}/input_items",
                          headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    # Then each prompt held the turns before it
    assert second["previous_response_id"] == first["id"]
    assert second["usage"]["input_tokens"] >= \
        alone["usage"]["input_tokens"] + first["usage"]["output_tokens"] + 5
    assert third["usage"]["input_tokens"] > second["usage"]["input_tokens"] + 5
    assert [i["content"][0]["text"] for i in items["data"]] == ["Say it again."]


def test_calls_are_audited_as_responses(live: Live, org: Org,
                                        client: openai.OpenAI) -> None:
    # Given an answered call and a refused one
    answered = client.responses.create(model="echo", input="audited")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="echo", input="x", max_output_tokens=0)

    # Then each has its audit event under the API's own action
    def events() -> list[tuple[str, int, int, str]]:
        audit.drain()
        return sorted(AuditEvent.objects.filter(tenant=org.tenant, action="responses")
                      .values_list("action", "status", "prompt_tokens", "request_id"))

    rid = answered.id.removeprefix("resp_")
    assert eventually(lambda: events() == [("responses", 200, 7, rid),
                                           ("responses", 400, 0, "")], 15), events()


def test_the_openapi_document_describes_the_route_and_its_replies(
        live: Live, client: openai.OpenAI, roomy: str) -> None:
    document = httpx.get(live.base_url.removesuffix("/v1") + "/api/openapi.json",
                         timeout=30).json()
    assert {"/v1/responses", "/v1/responses/{response_id}",
            "/v1/responses/{response_id}/input_items"} <= set(document["paths"])
    schema = {"$ref": "#/components/schemas/ResponseObject",
              "components": document["components"]}
    replies = [client.responses.create(model="echo", input="described"),
               client.responses.create(model=roomy, input="Weather?", tools=[WEATHER],
                                       tool_choice="required")]
    for reply in replies:
        jsonschema.validate(reply.model_dump(mode="json", exclude_unset=True), schema)
    assert {item.type for reply in replies for item in reply.output} == \
        {"message", "function_call"}
