"""Tool calling through the openai SDK. The chat model here has random weights, so every
valid call it makes is the constrained decoder's doing, not the model's."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer"}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]



@pytest.fixture
def tiny(roomy: str) -> str:
    """The toy model with room for the tool prompt and a whole call (1,024 tokens)."""
    return roomy

@pytest.fixture
def client(live: Live, tiny: str) -> openai.OpenAI:
    key = make_org("alice", [Role.DEVELOPER]).keys[Role.DEVELOPER]
    return openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=60)


def calls_of(reply: Any) -> list[tuple[str, dict[str, Any]]]:
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def call_of(reply: Any) -> tuple[str, dict[str, Any]]:
    [call] = calls_of(reply)
    return call


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_function_arguments_validate_against_its_schema(
        client: openai.OpenAI, tiny: str, temperature: float) -> None:
    for seed in range(3):
        reply = client.chat.completions.create(
            model=tiny, messages=ASK, tools=[WEATHER, TIME], temperature=temperature,
            seed=seed, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        name, arguments = call_of(reply)
        assert name == "get_weather"
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_the_tools_several_only_when_parallel(
        client: openai.OpenAI, tiny: str, parallel: bool) -> None:
    """A model that wants to go on after a call (its logit_bias favours the first token
    of the call marker) makes several valid calls with parallel_tool_calls (as many as
    its max_tokens leave room for, up to the limit), and exactly one without."""
    from transformers import AutoTokenizer

    from inference.weights import smollm2_tokenizer_dir

    marker = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir())).encode("<")[0]
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        **TIME["function"]["parameters"], "additionalProperties": False}}}
    reply = client.chat.completions.create(
        model=tiny, messages=ASK, tools=[clock], tool_choice="required",
        max_tokens=200, temperature=1.0, seed=3, parallel_tool_calls=parallel,
        logit_bias={str(marker): 100})
    calls = calls_of(reply)
    assert len(calls) > 1 if parallel else len(calls) == 1, calls
    for name, arguments in calls:
        assert name == "get_time"
        jsonschema.validate(arguments, TIME["function"]["parameters"])


def test_tool_call_streams_as_a_delta(client: openai.OpenAI, tiny: str) -> None:
    chunks = list(client.chat.completions.create(
        model=tiny, messages=ASK, tools=[TIME], tool_choice="required", stream=True,
        parallel_tool_calls=False))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert {tc.index for tc in pieces} == {0} and pieces[0].function.name == "get_time"
    arguments = "".join(tc.function.arguments or "" for tc in pieces)
    assert json.loads(arguments)["zone"] in ("UTC", "CET")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_tool_result_round_trip(client: openai.OpenAI, tiny: str) -> None:
    first = client.chat.completions.create(
        model=tiny, messages=ASK, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    follow_up = client.chat.completions.create(model=tiny, max_tokens=8, tools=[WEATHER],
                                               tool_choice="none", messages=[
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'},
    ])
    assert follow_up.choices[0].finish_reason in ("stop", "length")
    assert follow_up.choices[0].message.tool_calls is None
    without = client.chat.completions.create(model=tiny, max_tokens=8, messages=ASK)
    assert follow_up.usage and without.usage
    # The call and its result reached the model as context.
    assert follow_up.usage.prompt_tokens > without.usage.prompt_tokens + 20


@pytest.mark.parametrize(("tools", "choice", "fragment"), [
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"xs": {"not": {}}}}}}], "required", "not"),
    ([{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}}], "required",
     "additionalProperties"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "nope"),
    (None, "required", "no tools"),
    ([WEATHER, WEATHER], "auto", "unique"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "name"),
])
def test_invalid_tools_are_400(client: openai.OpenAI, tiny: str, tools: Any, choice: Any,
                               fragment: str) -> None:
    kwargs: dict[str, Any] = {"tool_choice": choice}
    if tools is not None:
        kwargs["tools"] = tools
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=tiny, messages=ASK, **kwargs)
    assert fragment in str(err.value)


def test_echo_model_cannot_call_tools(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="echo", messages=ASK, tools=[WEATHER],
                                       tool_choice="required")
    assert "cannot call tools" in str(err.value)
