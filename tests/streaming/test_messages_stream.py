"""Anthropic Messages streaming through the official anthropic SDK against a live
Sluice: `message_start` reports the prompt's real token count (the figure the final
usage has), and a tool call's input arrives as it is generated, in several
`input_json_delta`s that join into the final input."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import pytest

from tenants.roles import Role
from tests.conftest import Org, make_org
from tests.streaming.conftest import Live
from tests.streaming.test_anthropic import WEATHER

pytestmark = pytest.mark.slow


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("alice", [Role.DEVELOPER])


def sdk(live: Live, org: Org) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.base_url.removesuffix("/v1"),
                               api_key=org.keys[Role.DEVELOPER], max_retries=0, timeout=60)


def streamed(client: anthropic.Anthropic, **kw: Any) -> tuple[list[Any], Any]:
    """The raw events of one SDK stream and its accumulated final message."""
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        return events, stream.get_final_message()


def test_message_start_reports_the_prompts_token_count(live: Live, org: Org) -> None:
    # given a streamed text reply
    client = sdk(live, org)
    # when the SDK streams it
    events, final = streamed(client, model="echo", max_tokens=50, system="Be brief.",
                             messages=[{"role": "user", "content": "count my tokens " * 5}])
    # then message_start already has the input tokens the final usage reports
    [start] = [e for e in events if e.type == "message_start"]
    assert final.usage.input_tokens > 0
    assert start.message.usage.input_tokens == final.usage.input_tokens
    # and it came before any text
    assert events[0].type == "message_start"


def forced_weather_call(live: Live, org: Org, roomy: str) -> tuple[list[Any], Any]:
    """The SDK's streamed events and final message of a forced get_weather call, with room
    for a long one: the random model may write the city's characters as \\uXXXX escapes,
    six tokens each (at 120 tokens one such call had ended at max_tokens in CI)."""
    return streamed(sdk(live, org), model=roomy, max_tokens=400, tools=[WEATHER],
                    tool_choice={"type": "tool", "name": "get_weather"},
                    messages=[{"role": "user", "content": "Weather in Oslo?"}])


def test_a_tool_only_reply_reports_its_prompt_count_at_start(live: Live, org: Org,
                                                             roomy: str) -> None:
    # given a forced tool call on the tiny model (no text before the call)
    # when the SDK streams it
    events, final = forced_weather_call(live, org, roomy)
    # then message_start has the real input count too
    [start] = [e for e in events if e.type == "message_start"]
    assert final.stop_reason == "tool_use"
    assert start.message.usage.input_tokens == final.usage.input_tokens > 0


def test_a_tool_calls_input_streams_in_pieces_that_join_into_it(live: Live, org: Org,
                                                                roomy: str) -> None:
    # given a forced tool call on the tiny model
    # when the SDK streams it
    events, final = forced_weather_call(live, org, roomy)
    # then its input came as several input_json_deltas, in one tool_use block
    [use] = [b for b in final.content if b.type == "tool_use"]
    [start] = [e for e in events if e.type == "content_block_start"]
    assert start.content_block.type == "tool_use" and start.content_block.id == use.id
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(pieces) > 1
    # and they join into the final input, which is valid against the schema
    assert json.loads("".join(pieces)) == use.input
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert [e.type for e in events][-3:] == ["content_block_stop", "message_delta",
                                              "message_stop"]
