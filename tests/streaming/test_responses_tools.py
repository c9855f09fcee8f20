"""The Responses API's namespace and custom tools (streaming/apis/responses/tools.py),
and Codex CLI 0.171.0's captured first requests, through the official openai SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import openai
import pytest

from tenants.roles import Role
from tests.conftest import Org, make_org
from tests.streaming.conftest import Live, _tiny_worker
from tests.streaming.test_responses import WEATHER, sdk

pytestmark = pytest.mark.slow
FIXTURES = Path(__file__).parent / "fixtures"
WEATHER_NS: Any = {"type": "namespace", "name": "weather", "description": "Weather tools",
              "tools": [{k: v for k, v in WEATHER.items()}]}
# A namespaced function named by `namespace` beside `name` (or by weather__get_weather).
FORCE_NS: Any = {"type": "function", "name": "get_weather", "namespace": "weather"}
# A bounded grammar: the engine ends the input within a few tokens (free text from the
# random-weights model would run to max_output_tokens).
RUN: Any = {"type": "custom", "name": "run", "description": "Runs a shell command",
            "format": {"type": "grammar", "syntax": "regex", "definition": "ls( -l)?"}}


@pytest.fixture
def client(live: Live) -> openai.OpenAI:
    org: Org = make_org("alice", [Role.DEVELOPER])
    return sdk(live, org.keys[Role.DEVELOPER])


@pytest.fixture
def long_tiny(live: Live) -> Iterator[str]:
    """The tiny model with a context that holds Codex's prompt."""
    yield from _tiny_worker("tiny-long", 16384)


def test_a_forced_namespaced_call_carries_its_namespace_and_round_trips(
        client: openai.OpenAI, roomy: str) -> None:
    response = client.responses.create(
        model=roomy, input="What's the weather in Paris?", tools=[WEATHER_NS],
        tool_choice=FORCE_NS,
        max_output_tokens=60, store=False)
    call = response.output[-1].model_dump()
    assert (call["type"], call["name"], call["namespace"]) == (
        "function_call", "get_weather", "weather")
    json.loads(call["arguments"])
    assert response.tools[0].model_dump()["type"] == "namespace"
    follow = client.responses.create(
        model=roomy, tools=[WEATHER_NS], tool_choice="none", max_output_tokens=4,
        store=False, input=cast(Any, [
            {"role": "user", "content": "What's the weather in Paris?"},
            {"type": "function_call", "call_id": call["call_id"], "name": "get_weather",
             "namespace": "weather", "arguments": call["arguments"]},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny"}]))
    assert follow.status in ("completed", "incomplete")
    assert follow.output[0].type == "message"


def test_a_forced_custom_tool_streams_its_input(client: openai.OpenAI, roomy: str) -> None:
    events: list[Any] = list(client.responses.create(
        model=roomy, input="List the files", tools=[RUN],
        tool_choice={"type": "custom", "name": "run"}, max_output_tokens=60, store=False,
        stream=True))
    kinds = [e.type for e in events]
    assert "response.custom_tool_call_input.delta" in kinds
    done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
    assert kinds[-1] == "response.completed"
    call = events[-1].response.output[-1].model_dump()
    assert call["type"] == "custom_tool_call" and call["name"] == "run"
    assert call["input"] in ("ls", "ls -l") and call["input"] == done.input
    deltas = "".join(e.delta for e in events
                     if e.type == "response.custom_tool_call_input.delta")
    assert deltas == call["input"]
    follow = client.responses.create(
        model=roomy, tools=[RUN], tool_choice="none", max_output_tokens=4, store=False,
        input=cast(Any, [{"role": "user", "content": "List the files"},
               {"type": "custom_tool_call", "call_id": call["call_id"], "name": "run",
                "input": call["input"]},
               {"type": "custom_tool_call_output", "call_id": call["call_id"],
                "output": "a.txt"}]))
    assert follow.output[0].type == "message"


@pytest.mark.parametrize("fixture", ["codex_0.171.0_first_request.json",
                                     "codex_0.171.0_first_request_default_model.json"])
def test_codex_first_request_is_accepted(client: openai.OpenAI, long_tiny: str,
                                         fixture: str) -> None:
    body: dict[str, Any] = json.loads((FIXTURES / fixture).read_text())
    body = body.get("body", body)
    body.update(model=long_tiny, max_output_tokens=8)
    body.pop("stream", None)
    extra = {k: body.pop(k) for k in ("client_metadata",) if k in body}
    events: list[Any] = list(client.responses.create(**body, stream=True, extra_body=extra))
    assert events[-1].type in ("response.completed", "response.incomplete")


@pytest.mark.parametrize(("tools", "param"), [
    ([{"type": "namespace", "name": "ns", "description": "", "tools": []}], "tools[0].tools"),
    ([{**RUN, "format": {"type": "grammar", "syntax": "ebnf", "definition": "x"}}],
     "tools[0].format.syntax"),
    ([WEATHER_NS, {**WEATHER_NS, "tools": [RUN]}], "tools[1].name"),
    ([WEATHER_NS, {**WEATHER, "name": "weather__get_weather"}], "tools[1].name"),
])
def test_bad_tools_are_400s_naming_the_field(client: openai.OpenAI, tools: list[Any],
                                             param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="echo", input="hi", tools=tools)
    assert caught.value.param == param
