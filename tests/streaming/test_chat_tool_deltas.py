"""Chat Completions streams tool calls as OpenAI does, read by the official openai SDK
against a live Sluice (the toy model under a tools grammar): a call's first chunk has its
id, type and name with empty arguments, its arguments follow in pieces as the model
writes them, and they join into exactly what a call that is not streamed returns. The
encoder's other cases (calls that come whole with the final event, a call's missing
tail, a call cut short) are read through `bodies.ToolDeltas` directly."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import httpx
import openai
import pydantic
import pytest
import websockets

from inference.jobs import DoneEvent, ToolDelta
from streaming.apis.bodies import ToolDeltas
from streaming.protos import inference_pb2 as pb
from streaming.protos import inference_pb2_grpc as pb_grpc
from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live
from tests.streaming.test_aliases_upstream import Front, front  # noqa: F401  (a fixture)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "required": ["city", "unit"],
                   "additionalProperties": False, "properties": {
                       "city": {"type": "string", "maxLength": 20},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
def client(live: Live, roomy: str) -> openai.OpenAI:
    key = make_org("alice", [Role.DEVELOPER]).keys[Role.DEVELOPER]
    return openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=60)


def joined(chunks: list[Any]) -> dict[int, dict[int, dict[str, Any]]]:
    """Each choice's calls, by index, joined from the chunks' tool-call deltas as an
    OpenAI client joins them; `first` is the arguments of a call's first delta (its
    whole arguments for a call that was not streamed), `pieces` counts the others."""
    out: dict[int, dict[int, dict[str, Any]]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                calls = out.setdefault(choice.index, {})
                if delta.index not in calls:
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name,
                                          "first": delta.function.arguments, "pieces": 0,
                                          "arguments": delta.function.arguments}
                else:
                    assert delta.id is None and delta.function.name is None
                    calls[delta.index]["arguments"] += delta.function.arguments
                    calls[delta.index]["pieces"] += 1
    return out


@pytest.mark.slow
def test_a_calls_arguments_stream_in_pieces_that_join_into_the_unstreamed_reply(
        client: openai.OpenAI, roomy: str) -> None:
    ask: dict[str, Any] = {"model": roomy, "messages": ASK, "tools": [WEATHER],
                           "tool_choice": FORCED, "temperature": 0.0, "max_tokens": 120}
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    [[call]] = [list(calls.values()) for calls in joined(chunks).values()]
    assert call["first"] == "" and call["pieces"] > 2, "written, then sent, piece by piece"
    [expected] = whole.choices[0].message.tool_calls or []
    assert (call["name"], call["arguments"]) == (expected.function.name,
                                                 expected.function.arguments)
    json.loads(call["arguments"])
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls" and finishes.count("tool_calls") == 1
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    unit: str


@pytest.mark.slow
def test_the_sdks_stream_helper_accumulates_and_parses_the_final_completion(
        client: openai.OpenAI, roomy: str) -> None:
    """An agent's loop: the SDK's `chat.completions.stream` helper, a strict pydantic
    tool; its argument-delta events join into its final completion's parsed call."""
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    ask: dict[str, Any] = {"model": roomy, "messages": ASK, "tools": [tool],
                           "tool_choice": FORCED, "temperature": 0.0, "max_tokens": 120}
    deltas: list[str] = []
    done: list[str] = []
    with client.chat.completions.stream(**ask) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                deltas.append(event.arguments_delta)
            elif event.type == "tool_calls.function.arguments.done":
                done.append(event.arguments)
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls or []
    assert len(deltas) > 2 and done == ["".join(deltas)] == [call.function.arguments]
    assert isinstance(call.function.parsed_arguments, Weather)
    assert final.choices[0].finish_reason == "tool_calls"
    whole = client.chat.completions.create(**ask)
    assert call.function.arguments == (whole.choices[0].message.tool_calls or [])[
        0].function.arguments


@pytest.mark.slow
def test_n_choices_each_stream_their_own_call(client: openai.OpenAI, roomy: str) -> None:
    ask: dict[str, Any] = {"model": roomy, "messages": ASK, "tools": [WEATHER],
                           "tool_choice": FORCED, "temperature": 1.0, "seed": 4, "n": 2,
                           "max_tokens": 120}
    whole = client.chat.completions.create(**ask)
    calls = joined(list(client.chat.completions.create(**ask, stream=True)))
    assert sorted(calls) == [0, 1]
    for choice in whole.choices:
        [streamed] = calls[choice.index].values()
        [expected] = choice.message.tool_calls or []
        assert streamed["first"] == "" and streamed["pieces"] > 2
        assert streamed["arguments"] == expected.function.arguments
    assert calls[0][0]["id"] != calls[1][0]["id"]


@pytest.mark.slow
def test_a_text_reply_streams_as_text_only(client: openai.OpenAI, roomy: str) -> None:
    ask: dict[str, Any] = {"model": roomy, "messages": ASK, "tools": [WEATHER],
                           "tool_choice": "none", "temperature": 0.0, "max_tokens": 12}
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert not joined(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        whole.choices[0].finish_reason


@pytest.mark.slow
def test_a_resumed_stream_sends_only_the_pieces_the_client_lacks(
        live: Live, client: openai.OpenAI, roomy: str) -> None:
    body = {"model": roomy, "messages": ASK, "tools": [WEATHER], "tool_choice": FORCED,
            "temperature": 0.0, "max_tokens": 120, "stream": True}
    url = f"{live.base_url}/chat/completions"
    auth = {"Authorization": f"Bearer {client.api_key}"}
    with httpx.Client(timeout=60) as http:
        response = http.post(url, json=body, headers=auth)
        events = sse(response.text)
        whole = "".join(a for _i, c in events for a in arguments(c))
        # the client left after the call's name and its first two pieces
        cut = [n for n, (i, c) in enumerate(events) if i and arguments(c)][1]
        resumed = http.post(url, json=body, headers={**auth,
                                                     "Last-Event-ID": events[cut][0]})
    assert resumed.status_code == 200
    head = "".join(a for _i, c in events[:cut + 1] for a in arguments(c))
    rest = "".join(a for _i, c in sse(resumed.text) for a in arguments(c))
    assert head and rest and head + rest == whole
    json.loads(whole)


@pytest.mark.slow
def test_the_websocket_streams_a_calls_pieces_and_ends_with_it_whole(
        live: Live, client: openai.OpenAI, roomy: str) -> None:
    url = live.base_url.replace("http://", "ws://") + "/chat/socket"
    request = {"model": roomy, "messages": ASK, "tools": [WEATHER], "tool_choice": FORCED,
               "temperature": 0.0, "max_tokens": 120}

    async def go() -> list[dict[str, Any]]:
        async with websockets.connect(url, additional_headers={
                "Authorization": f"Bearer {client.api_key}"}) as ws:
            await ws.send(json.dumps({"type": "chat.request", "id": "r1", "request": request}))
            frames = [json.loads(await asyncio.wait_for(ws.recv(), 30))]
            while frames[-1]["type"] not in ("chat.done", "error"):
                frames.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            return frames

    frames = asyncio.run(go())
    assert frames[-1]["type"] == "chat.done", frames[-1]
    pieces = [d for f in frames[:-1] for d in f.get("tool_calls") or ()]
    assert pieces[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert len(pieces) > 3 and all(p["index"] == 0 for p in pieces)
    [call] = frames[-1]["tool_calls"]
    assert call["id"] == pieces[0]["id"]
    assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]


@pytest.mark.slow
def test_grpc_chunks_stream_a_calls_pieces_and_the_last_has_it_whole(
        grpc_target: str, client: openai.OpenAI, roomy: str) -> None:
    request = pb.ChatRequest(
        model=roomy, max_tokens=120, temperature=0.0, tool_choice="get_weather",
        messages=[pb.ChatMessage(role="user", content=ASK[0]["content"])],
        tools=[pb.Tool(type="function", function=pb.FunctionDef(name="get_weather"))])
    request.tools[0].function.parameters.update(WEATHER["function"]["parameters"])
    auth = (("authorization", f"Bearer {client.api_key}"),)

    async def go() -> list[Any]:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            return [c async for c in stub.ChatStream(request, metadata=auth, timeout=60)]

    chunks = asyncio.run(go())
    assert chunks[-1].finish_reason == "tool_calls"
    pieces = [t for c in chunks[:-1] for t in c.tool_calls]
    assert len(pieces) > 3 and pieces[0].function.name == "get_weather"
    assert pieces[0].function.arguments == "" and pieces[0].id
    assert all(p.index == 0 and not p.function.name for p in pieces[1:])
    [call] = chunks[-1].tool_calls
    assert call.id == pieces[0].id
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments


@pytest.mark.slow
def test_pieces_pass_through_an_upstream_sluice(
        front: Front, roomy: str) -> None:  # noqa: F811
    """An upstream deployment's worker reads a second Sluice's stream of pieces; the
    front's stream joins into the call its unstreamed reply has (whether that worker
    passes the pieces on or sends the call whole with its final event)."""
    _proc, base = front.upstream_server()
    front.deployment("up-tiny", base, roomy, max_context=1024)
    ask: dict[str, Any] = {"model": "up-tiny", "messages": ASK, "tools": [WEATHER],
                           "tool_choice": FORCED, "temperature": 0.0, "max_tokens": 120}
    whole = front.caller().chat.completions.create(**ask)
    [[call]] = [list(c.values()) for c in joined(list(
        front.caller().chat.completions.create(**ask, stream=True))).values()]
    [expected] = whole.choices[0].message.tool_calls or []
    assert (call["name"], call["arguments"]) == ("get_weather", expected.function.arguments)
    json.loads(call["arguments"])


def sse(body: str) -> list[tuple[str, Any]]:
    """(id, chunk) of each SSE event with a chunk; id "" when the event has none."""
    out = []
    for frame in body.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in frame.splitlines() if ": " in line)
        if fields.get("data", "[DONE]") != "[DONE]":
            out.append((fields.get("id", ""), json.loads(fields["data"])))
    return out


def arguments(chunk: dict[str, Any]) -> list[str]:
    return [d["function"]["arguments"] for c in chunk.get("choices") or ()
            for d in c["delta"].get("tool_calls") or ()]


# -- the encoder's cases the toy model does not make on demand ----------------------
CALLS = [("call_1", "get_weather", '{"city": "Oslo", "unit": "celsius"}'),
         ("call_2", "get_time", '{"zone": "CET"}')]


def final(calls: list[tuple[str, str, str]] = CALLS, finish: str = "tool_calls") -> DoneEvent:
    return {"t": "done", "seq": 9, "finish": finish,
            "usage": {"prompt_tokens": 7, "completion_tokens": 30},
            "tool_calls": [{"id": i, "name": n, "arguments": a} for i, n, a in calls]}


def streamed(deltas: ToolDeltas, k: int, upto: int) -> list[list[dict[str, Any]]]:
    call_id, name, args = CALLS[k]
    pieces: list[ToolDelta] = [{"index": k, "id": call_id, "name": name, "arguments": ""}]
    pieces += [{"index": k, "arguments": args[i:min(i + 4, upto)]} for i in range(0, upto, 4)]
    return deltas.pieces(pieces)


def join(chunks: list[list[dict[str, Any]]]) -> dict[int, tuple[str, str, str]]:
    calls: dict[int, tuple[str, str, str]] = {}
    for chunk in chunks:
        for d in chunk:
            call_id, name, args = calls.get(d["index"], ("", "", ""))
            calls[d["index"]] = (d.get("id", call_id), d["function"].get("name", name),
                                 args + d["function"]["arguments"])
    return calls


def test_calls_that_come_whole_with_the_final_event_are_sent_whole() -> None:
    deltas = ToolDeltas()
    rest = deltas.rest(final())
    assert [d["type"] for d in rest] == ["function", "function"]
    assert join([rest]) == {0: CALLS[0], 1: CALLS[1]}


def test_streamed_pieces_and_the_final_event_join_into_the_final_calls_exactly() -> None:
    deltas = ToolDeltas()
    chunks = streamed(deltas, 0, len(CALLS[0][2]))
    assert len(chunks) > 4 and all(len(c) == 1 for c in chunks)
    chunks += streamed(deltas, 1, 5)  # the second call's tail only comes with the final
    rest = deltas.rest(final())
    assert rest == [{"index": 1, "function": {"arguments": CALLS[1][2][5:]}}]
    assert join([*chunks, rest]) == {0: CALLS[0], 1: CALLS[1]}


def test_a_call_cut_short_by_the_length_adds_nothing_at_the_end() -> None:
    deltas = ToolDeltas()
    chunks = streamed(deltas, 0, 6)
    assert deltas.rest(final([], finish="length")) == []
    assert join(chunks) == {0: (*CALLS[0][:2], CALLS[0][2][:6])}
