"""Tool traffic to an upstream deployment, natively: the earlier calls of a
conversation (an assistant's `tool_calls`, `tool` results with their `tool_call_id`)
and the tools' descriptions reach the upstream server as OpenAI's chat API has them,
not as text. The upstream is a second Sluice gateway (tests/streaming/
test_aliases_upstream.py's Front) serving the tiny model; what it saw is its own
prompt token count, which equals the count of the same request sent to it directly
only when the messages arrived as they were sent (text would have been rendered
twice: a tool result's "[result of ...]" prefix again, the description missing)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from openai import OpenAI

from tests.streaming.conftest import roomy  # noqa: F401  (a fixture)
from tests.streaming.test_aliases_upstream import Front, front  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow

PARAMS: Any = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
               "required": ["city"], "additionalProperties": False}
TOOLS: Any = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, today or tomorrow",
    "parameters": PARAMS}}]
CONVERSATION: Any = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_w1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_w1", "content": "18C and sunny"},
    {"role": "user", "content": "And in Bergen?"},
]


def _direct_count(via: Front, base: str, model: str) -> int:
    """The upstream's prompt count of the conversation sent to it directly."""
    direct = OpenAI(base_url=base, api_key=via.relay_key, max_retries=0, timeout=60)
    reply = direct.chat.completions.create(model=model, messages=CONVERSATION, tools=TOOLS,
                                           max_tokens=2)
    assert reply.usage is not None
    return reply.usage.prompt_tokens


def test_tool_calls_and_results_reach_an_upstream_natively(
        front: Front, roomy: str) -> None:  # noqa: F811
    # given an upstream deployment of a second Sluice's tiny model
    _proc, base = front.upstream_server()
    front.deployment("up-tiny", base, roomy, max_context=1024)
    # when a conversation with an earlier call and its result goes through the front
    reply = front.caller().chat.completions.create(
        model="up-tiny", messages=CONVERSATION, tools=TOOLS, max_tokens=2)
    # then the upstream counted the prompt it counts for the same request sent directly
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == _direct_count(front, base, roomy)


def test_anthropic_tool_use_and_results_reach_an_upstream_natively(
        front: Front, roomy: str) -> None:  # noqa: F811
    # given the same upstream deployment, called through Anthropic's Messages API
    _proc, base = front.upstream_server()
    front.deployment("up-tiny", base, roomy, max_context=1024)
    client = anthropic.Anthropic(base_url=front.live.base_url.removesuffix("/v1"),
                                 api_key=front.caller().api_key, max_retries=0, timeout=60)
    # when its tool_use and tool_result blocks go through the front
    reply = client.messages.create(
        model="up-tiny", max_tokens=2,
        tools=[{"name": "get_weather", "description": TOOLS[0]["function"]["description"],
                "input_schema": PARAMS}],
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "call_w1",
                                               "name": "get_weather",
                                               "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_w1", "content": "18C and sunny"},
                {"type": "text", "text": "And in Bergen?"}]}])
    # then the upstream saw the chat API's tool messages and the tool's description
    assert reply.usage.input_tokens == _direct_count(front, base, roomy)


def test_a_streamed_tool_call_from_an_upstream_arrives_in_pieces(
        front: Front, roomy: str) -> None:  # noqa: F811
    # given an upstream deployment of a second Sluice's tiny model, which streams the
    # arguments of the calls it makes as they are written
    _proc, base = front.upstream_server()
    front.deployment("up-tiny", base, roomy, max_context=1024)
    # when a streamed call through the front must call the tool
    stream = front.caller().chat.completions.create(
        model="up-tiny", messages=CONVERSATION[:1], tools=TOOLS, tool_choice="required",
        max_tokens=100, stream=True)
    pieces = [(call.index, call.function.arguments) for chunk in stream
              for choice in chunk.choices for call in choice.delta.tool_calls or []
              if call.function is not None and call.function.arguments]
    # then the arguments came in pieces, as the upstream wrote them, and each call's
    # join into its whole arguments (the model may make more than one call)
    assert len(pieces) > 2, pieces
    calls: dict[int, str] = {}
    for index, piece in pieces:
        calls[index] = calls.get(index, "") + piece
    assert all(isinstance(json.loads(arguments)["city"], str)
               for arguments in calls.values()), calls
