"""Forced tool calls at the edge of their budget, through the official openai and
anthropic SDKs: a call whose schema holds an array of objects completes valid within
max_tokens (the closing rule ends the array once minItems allow), and a call cut by
max_tokens comes back with its arguments as far as they were written, finish "length",
on Chat (plain and streamed), gRPC, Responses (incomplete) and Messages (max_tokens). The
model has random weights: every call's shape is the constrained decoder's doing."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from google.protobuf.struct_pb2 import Struct

from streaming.protos import inference_pb2 as pb
from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live
from tests.streaming.test_grpc import call as grpc_call

pytestmark = pytest.mark.slow

EDIT_FILE: Any = {"type": "object", "properties": {
    "path": {"type": "string"},
    "edits": {"type": "array", "minItems": 1, "items": {
        "type": "object", "properties": {"old": {"type": "string"}, "new": {"type": "string"}},
        "required": ["old", "new"]}}}, "required": ["path", "edits"]}
TOOL: Any = {"type": "function", "function": {"name": "edit_file", "parameters": EDIT_FILE}}
RESPONSES_TOOL: Any = {"type": "function", "name": "edit_file", "parameters": EDIT_FILE}
MESSAGES_TOOL: Any = {"name": "edit_file", "input_schema": EDIT_FILE}
FORCED: Any = {"type": "function", "function": {"name": "edit_file"}}
ASK: Any = [{"role": "user", "content": "Rename foo to bar in main.py."}]


@pytest.fixture
def key(live: Live, roomy: str) -> str:
    return make_org("alice", [Role.DEVELOPER]).keys[Role.DEVELOPER]


@pytest.fixture
def client(live: Live, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=60)


def test_a_forced_call_with_an_array_of_objects_completes_valid_within_400_tokens(
        client: openai.OpenAI, roomy: str) -> None:
    # given a forced edit_file call (edits: minItems 1) and 400 tokens
    reply = client.chat.completions.create(model=roomy, messages=ASK, tools=[TOOL],
                                           tool_choice=FORCED, max_tokens=400, seed=1)
    # then the call is complete: its arguments parse and validate, within the budget
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "edit_file"
    jsonschema.validate(json.loads(call.function.arguments), EDIT_FILE)
    assert reply.usage is not None and reply.usage.completion_tokens <= 400


def _cut(arguments: Any) -> str:
    """`arguments`, checked to be a call's cut arguments (not JSON, begun as the schema's
    object)."""
    assert arguments.startswith('{"path": "'), arguments
    with pytest.raises(ValueError):
        json.loads(arguments)
    return arguments


def test_a_call_cut_by_max_tokens_returns_its_arguments_so_far_on_every_api(
        live: Live, client: openai.OpenAI, key: str, roomy: str, grpc_target: str) -> None:
    # given a forced call whose 20 tokens cannot hold it (greedy: every reply the same)
    body: Any = {"model": roomy, "messages": ASK, "tools": [TOOL], "tool_choice": FORCED,
                 "max_tokens": 20, "temperature": 0}
    # when Chat answers it plain
    reply = client.chat.completions.create(**body)
    # then the call has the arguments written so far, finish "length"
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    [call] = choice.message.tool_calls or []
    assert call.function.name == "edit_file" and call.id.startswith("call_")
    arguments = _cut(call.function.arguments)
    # and streamed, its pieces join into the same arguments, finish "length"
    pieces, finishes = [], []
    for chunk in client.chat.completions.create(**body, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            pieces.append(delta.function.arguments if delta.function else "")
        finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert "".join(p or "" for p in pieces) == arguments and finishes == ["length"]
    # and gRPC (the same fold as chat's) has the call, plain and in its stream's last chunk
    parameters = Struct()
    parameters.update(EDIT_FILE)
    request = pb.ChatRequest(
        model=roomy, messages=[pb.ChatMessage(role="user", content=ASK[0]["content"])],
        max_tokens=20, temperature=0, tool_choice="edit_file", tools=[pb.Tool(
            type="function", function=pb.FunctionDef(name="edit_file", parameters=parameters))])
    answer = grpc_call(grpc_target, "Chat", request, key=key)
    last = grpc_call(grpc_target, "ChatStream", request, key=key)[-1]
    for finish, calls in ((answer.finish_reason, answer.message.tool_calls),
                          (last.finish_reason, last.tool_calls)):
        [piece] = calls  # its schema's keys in the Struct's order: not the same text
        assert finish == "length" and piece.function.name == "edit_file"
        with pytest.raises(ValueError):
            json.loads(piece.function.arguments)
    # and Responses: incomplete (max_output_tokens), the call item with the arguments
    response = client.responses.create(
        model=roomy, input=ASK[0]["content"], max_output_tokens=20, temperature=0,
        tools=[RESPONSES_TOOL], tool_choice={"type": "function", "name": "edit_file"})
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    [item] = response.output
    assert item.type == "function_call" and item.status == "incomplete"
    _cut(item.arguments)
    # and Messages: stop_reason max_tokens, a tool_use block whose input keeps the text
    # written (not JSON: wrapped as Anthropic's docs wrap invalid tool input)
    messages = anthropic.Anthropic(base_url=live.base_url.removesuffix("/v1"), api_key=key,
                                   max_retries=0, timeout=60)
    message = messages.messages.create(model=roomy, max_tokens=20, messages=ASK,
                                       tools=[MESSAGES_TOOL],
                                       tool_choice={"type": "tool", "name": "edit_file"})
    assert message.stop_reason == "max_tokens"
    [use] = message.content
    assert use.type == "tool_use" and use.name == "edit_file"
    assert set(use.input) == {"INVALID_JSON"}
    _cut(use.input["INVALID_JSON"])
