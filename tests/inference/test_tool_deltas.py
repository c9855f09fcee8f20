"""The output processor streams a tool call as the model writes it (DeltaEvent.tools):
the call's id and name once its name is complete, then its arguments piece by piece,
the pieces joining into the final event's arguments; a takeover's row continues the
pieces an earlier delivery streamed. The tiny model's tokenizer and grammar; the
tokens are the call's text, each consumed by the constraint as the runtime would."""

from __future__ import annotations

from typing import Any

import pytest

from inference.engine.entries import Pending
from inference.jobs import DeltaEvent, Event
from inference.runtimes import load_runtime
from inference.runtimes.causal_lm import CausalLMRuntime
from inference.spec import DeploymentSpec, RuntimeName
from inference.structured.grammar import TOOL_MARKER
from tests.inference.conftest import chat
from tests.inference.test_engine_parts import Harness, request

ARGUMENTS = '{"city": "Zürich", "unit": "celsius"}'
CALL = '{"name": "get_weather", "arguments": ' + ARGUMENTS + "}"
WEATHER: Any = {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "unit"], "additionalProperties": False,
    "properties": {"city": {"type": "string"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}


@pytest.fixture(scope="module")
def tiny() -> CausalLMRuntime:
    runtime = load_runtime(DeploymentSpec("tiny", RuntimeName.TINY_CAUSAL_LM,
                                          max_context=1024))
    assert isinstance(runtime, CausalLMRuntime)
    return runtime


def _job() -> Any:
    return chat("Weather in Zürich?", tools=[WEATHER], tool_choice="get_weather",
                max_tokens=200)


def _run(h: Harness, seq: Any, tokens: list[int]) -> list[Event]:
    for token in tokens:
        seq.constraint.advance(token)  # what the runtime does as it samples
        if h.output.handle({seq.rid: token}):
            break
    return h.events(seq.rid)


def _pieces(events: list[Event]) -> dict[int, str]:
    joined: dict[int, str] = {}
    for event in events:
        for piece in event.get("tools", []) if event["t"] == "delta" else []:
            joined[piece["index"]] = joined.get(piece["index"], "") + piece["arguments"]
    return joined


def test_a_call_streams_in_pieces_that_join_into_its_arguments(tiny: CausalLMRuntime) -> None:
    # given a forced call, generated token by token
    h = Harness(tiny)
    seq = h.start(_job())
    tokens = tiny.tokenizer.encode(CALL, add_special_tokens=False)
    # when its tokens are handled
    *deltas, final = _run(h, seq, tokens)
    # then the first delta names the call (with the prompt's count) and the arguments
    # follow in several pieces, no text among them
    assert final["t"] == "done" and final["finish"] == "tool_calls"
    first = deltas[0]
    assert first["t"] == "delta" and first["seq"] == 0 and first["prompt_tokens"] > 0
    assert first["tools"][0]["name"] == "get_weather"
    assert first["tools"][0]["id"] == final["tool_calls"][0]["id"]
    assert all(d["t"] == "delta" and d["text"] == "" for d in deltas)
    assert len(deltas) > 3
    # and they join into the final arguments, as the model wrote them
    assert _pieces(deltas) == {0: ARGUMENTS} and final["tool_calls"][0]["arguments"] == ARGUMENTS
    assert sum(len(d["ids"]) for d in deltas if d["t"] == "delta") <= len(tokens)


def test_a_takeover_continues_the_pieces_already_streamed(tiny: CausalLMRuntime) -> None:
    # given a first delivery that streamed part of the call
    tokens = tiny.tokenizer.encode(CALL, add_special_tokens=False)
    h = Harness(tiny)
    seq = h.start(_job())
    earlier: list[DeltaEvent] = []
    for token in tokens:
        seq.constraint.advance(token)
        h.output.handle({seq.rid: token})
        earlier = [e for e in h.events(seq.rid) if e["t"] == "delta"]
        if sum(len(e["ids"]) for e in earlier) >= len(tokens) // 2:
            break
    assert 0 < len(_pieces(earlier)[0]) < len(ARGUMENTS)
    done = sum(len(e["ids"]) for e in earlier)
    # when another worker takes the request over from those events
    again = Harness(tiny)
    prepared = again.inputs.prepare(Pending("t:0", "1-1", request(_job()), deliveries=2))
    prepared.row.resume(earlier)
    resumed = again.output.start(prepared.row, prepared.prompt, prepared.params)
    assert resumed is not None
    *later, final = _run(again, resumed, tokens[done:])
    # then its pieces carry on where the first stopped, and all of them join into
    # the final arguments
    assert later[0]["seq"] == earlier[-1]["seq"] + 1 and len(later) > 2  # still pieces
    assert all("name" not in p for d in later if d["t"] == "delta" for p in d["tools"])
    joined = _pieces(earlier)[0] + _pieces(later)[0]
    assert final["t"] == "done" and joined == final["tool_calls"][0]["arguments"] == ARGUMENTS


@pytest.mark.parametrize(("choice", "stream"), [("get_weather", False), ("get_weather", True),
                                               ("auto", False)])
def test_a_call_cut_by_max_tokens_ends_with_its_arguments_so_far(
        tiny: CausalLMRuntime, choice: str, stream: bool) -> None:
    # given a forced call (or an "auto" reply that began one) whose budget ends inside
    # its arguments
    head = TOOL_MARKER if choice == "auto" else ""
    tokens = tiny.tokenizer.encode(head + CALL, add_special_tokens=False)
    budget = len(tokens) - 4
    h = Harness(tiny)
    seq = h.start(chat("Weather in Zürich?", tools=[WEATHER], tool_choice=choice,
                       max_tokens=budget, stream=stream))
    # when the model has written that many tokens of it
    *deltas, final = _run(h, seq, tokens[:budget])
    # then the final event has the call with what was written of its arguments, the
    # finish "length" (not a reply with nothing in it)
    written = tiny.decode(tokens[:budget]).removeprefix(head).removeprefix(
        '{"name": "get_weather", "arguments": ')
    assert final["t"] == "done" and final["finish"] == "length"
    [call] = final["tool_calls"]
    assert call["name"] == "get_weather" and call["arguments"] == written
    assert ARGUMENTS.startswith(written) and 0 < len(written) < len(ARGUMENTS)
    assert final["usage"]["completion_tokens"] == budget
    # and a streamed reply's pieces join into exactly those arguments (none otherwise)
    assert _pieces(deltas) == ({0: written} if stream else {})


def test_a_budget_that_ends_with_the_last_call_is_a_whole_call(tiny: CausalLMRuntime) -> None:
    # given "required" calls (several may follow) whose budget ends right after the first
    tokens = tiny.tokenizer.encode(CALL, add_special_tokens=False)
    h = Harness(tiny)
    seq = h.start(chat("Weather in Zürich?", tools=[WEATHER], tool_choice="required",
                       max_tokens=len(tokens)))
    # when the call is written to its end
    final = _run(h, seq, tokens)[-1]
    # then the reply is that call, whole
    assert final["t"] == "done" and final["finish"] == "tool_calls"
    assert [c["arguments"] for c in final["tool_calls"]] == [ARGUMENTS]
