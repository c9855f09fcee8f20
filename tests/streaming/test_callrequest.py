"""The call's one internal request (streaming/pipeline/callrequest.py): each codec builds the same
request for the same call, the neutral check bounds it, and each API names the neutral
parameters of an error its own way."""

from __future__ import annotations

from typing import Any

import pytest

from inference.jobs import Keep
from sluice.errors import BadRequest
from streaming.apis import chat_request
from streaming.apis.completions import Completions
from streaming.apis.completions import call_request as completion_request
from streaming.apis.completions import parse as parse_completion
from streaming.apis.messages.codec import AnthropicMessagesRequest, Messages
from streaming.apis.messages.codec import call_request as messages_request
from streaming.apis.messages.codec import parse as parse_messages
from streaming.apis.responses.codec import ResponsesApi
from streaming.pipeline.callrequest import CallRequest, ParamError, check

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_chat_and_messages_build_the_same_request_for_the_same_call() -> None:
    # Given one conversation with a tool, as Chat Completions and as Anthropic send it
    chat = chat_request.call_request(chat_request.parsed({
        "model": "m", "max_tokens": 20, "temperature": 0.5, "stop": ["x"],
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": "weather?"},
                     {"role": "assistant", "content": None, "tool_calls": [{
                         "id": "c1", "type": "function",
                         "function": {"name": "get", "arguments": "{\"city\": \"Oslo\"}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "cold"}],
        "tools": [{"type": "function", "function": {"name": "get", "description": "d",
                                                    "parameters": WEATHER}}],
        "tool_choice": {"type": "function", "function": {"name": "get"}}}))
    anthropic = messages_request(parse_messages(AnthropicMessagesRequest, {
        "model": "m", "max_tokens": 20, "temperature": 0.5, "stop_sequences": ["x"],
        "system": "be brief",
        "messages": [{"role": "user", "content": "weather?"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "c1",
                                                        "name": "get",
                                                        "input": {"city": "Oslo"}}]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": "c1", "content": "cold"}]}],
        "tools": [{"name": "get", "description": "d", "input_schema": WEATHER}],
        "tool_choice": {"type": "tool", "name": "get"}}))
    # Then the call gets one request, whichever API it came through
    assert anthropic == chat
    assert chat.tool_choice == "function" and chat.tool_name == "get"
    assert chat.messages[2]["tool_calls"][0]["function"]["name"] == "get"
    check(chat)


def test_a_legacy_completion_is_a_raw_prompt_with_this_apis_defaults() -> None:
    req = completion_request(parse_completion({"model": "m", "prompt": "once",
                                               "logprobs": 2}), "once")
    assert req.raw_prompt and req.messages == [{"role": "user", "content": "once"}]
    assert (req.max_output_tokens, req.logprobs, req.top_logprobs) == (16, True, 2)
    assert (req.temperature, req.top_p, req.n) == (1.0, 1.0, 1)  # the request's defaults


@pytest.mark.parametrize(("change", "param"), [
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 9}, "n"),
    ({"messages": []}, "messages"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logit_bias": {1: 101.0}}, "logit_bias"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "a\x00b"}, "model"),
    ({"conversation_id": "conv_x"}, "conversation_id"),
])
def test_the_neutral_check_names_what_is_out_of_range(change: dict[str, Any],
                                                      param: str) -> None:
    req = CallRequest(**{"model": "m", "messages": [{"role": "user", "content": "hi"}],
                         **change})
    with pytest.raises(ParamError) as refused:
        check(req)
    assert refused.value.param == param and param in refused.value.message


@pytest.mark.parametrize(("api", "neutral", "named"), [
    (chat_request.PARAMS, "max_output_tokens", "max_tokens"),
    (chat_request.PARAMS, "tools[2].parameters", "tools[2].function.parameters"),
    (chat_request.PARAMS, "response_format.schema", "response_format.json_schema.schema"),
    (chat_request.PARAMS, "messages", "messages"),
    (ResponsesApi.params, "response_format.schema", "text.format.schema"),
    (ResponsesApi.params, "messages", "input"),
    (ResponsesApi.params, "tools[0].parameters", "tools[0].parameters"),
    (ResponsesApi.params, "max_output_tokens", "max_output_tokens"),
    (Messages.params, "tools[1].parameters", "tools.1.input_schema"),
    (Messages.params, "response_format.schema", "output_config.format.schema"),
    (Messages.params, "messages[3].role", "messages.3.role"),
    (Messages.params, "stop", "stop_sequences"),
    (Completions.params, "messages", "prompt"),
    (Completions.params, "max_output_tokens", "max_tokens"),
])
def test_each_api_names_a_neutral_parameter_its_own_way(api: Any, neutral: str,
                                                        named: str) -> None:
    # Given an error about a neutral parameter, quoting it
    error = api.named(ParamError("Invalid schema: ", neutral, ": nope", code="x"))
    # Then the API's name is both its param and the name its message quotes
    assert (error.param, error.message) == (named, f"Invalid schema: {named}: nope")
    # and an error that does not quote it has its param renamed only
    plain = api.named(BadRequest("Function names must be unique.", param=neutral))
    assert (plain.param, plain.message) == (named, "Function names must be unique.")


def test_an_idempotent_retry_is_the_same_request_whatever_its_deadline() -> None:
    keep = Keep(key="k", deletions="d", stream="s", by="b", draft="1", ttl_s=1,
                forget_s=1, maxlen=1)
    first = CallRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                        idempotency_key="a", timeout_s=3.0, keep=keep)
    retry = CallRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                        idempotency_key="a", timeout_s=1.5)
    other = CallRequest(model="m", messages=[{"role": "user", "content": "ho"}],
                        idempotency_key="a")
    assert first.fingerprint() == retry.fingerprint() != other.fingerprint()
