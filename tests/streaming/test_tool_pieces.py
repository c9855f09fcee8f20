"""The Anthropic and Responses encoders over a worker's tool-call pieces (the `tools`
of its delta events) for replies the live tests cannot make on demand: two calls
streamed one after the other, a call cut short by the reply's length, and calls that
arrive whole with the final event (an upstream deployment's). The encoded stream is
read back as the clients read it: Anthropic's through the anthropic SDK's own
stream helper, Responses' by joining each item's argument deltas."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx2

from inference.jobs import DoneEvent, ToolDelta
from streaming.apis.httpio import KeepAlive
from streaming.apis.messages.stream import _Blocks, tool_uses
from streaming.apis.responses.wire import EventStream, output

CALLS = [("call_r1", "get_weather", '{"city": "Oslo", "unit": "celsius"}'),
         ("call_r1_1", "get_time", '{"zone": "CET"}')]


def pieces() -> list[list[ToolDelta]]:
    """Each call's id and name, then its arguments three characters at a time."""
    out: list[list[ToolDelta]] = []
    for k, (call_id, name, arguments) in enumerate(CALLS):
        out.append([{"index": k, "id": call_id, "name": name, "arguments": ""}])
        out += [[{"index": k, "arguments": arguments[i:i + 3]}]
                for i in range(0, len(arguments), 3)]
    return out


def final(calls: list[tuple[str, str, str]] = CALLS, finish: str = "tool_calls") -> DoneEvent:
    event: DoneEvent = {"t": "done", "seq": 9, "finish": finish,
                        "usage": {"prompt_tokens": 7, "completion_tokens": 30}}
    if calls:
        event["tool_calls"] = [{"id": i, "name": n, "arguments": a} for i, n, a in calls]
    return event


def frames(chunks: list[bytes]) -> list[tuple[str, Any]]:
    out = []
    for frame in b"".join(chunks).decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        if lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


def anthropic_stream(streamed: list[list[ToolDelta]], end: DoneEvent) -> list[tuple[str, Any]]:
    sent: list[bytes] = []
    blocks = _Blocks(sent.append)
    for piece in streamed:
        blocks.tools(piece)
    blocks.finish(end)
    return frames(sent)


def accumulated(events: list[tuple[str, Any]]) -> anthropic.types.Message:
    """The message the anthropic SDK's stream builds from these events (served to it
    as a response body by its HTTP client's in-process transport)."""
    start = {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 7, "output_tokens": 0}}}
    body = b"".join(b"event: %s\ndata: %s\n\n" % (name.encode(), json.dumps(data).encode())
                    for name, data in [("message_start", start), *events])
    transport = httpx2.MockTransport(lambda _request: httpx2.Response(
        200, content=body, headers={"content-type": "text/event-stream"}))
    client = anthropic.Anthropic(api_key="k", base_url="http://sluice.test",
                                 http_client=httpx2.Client(transport=transport))
    with client.messages.stream(model="m", max_tokens=9, messages=[
            {"role": "user", "content": "hi"}]) as stream:
        return stream.get_final_message()


def test_two_streamed_calls_are_two_tool_use_blocks_whose_pieces_join_into_them() -> None:
    events = anthropic_stream(pieces(), final())
    names = [name for name, _ in events]
    # each call's block opens at its first piece and closes before the next opens
    starts = [i for i, n in enumerate(names) if n == "content_block_start"]
    stops = [i for i, n in enumerate(names) if n == "content_block_stop"]
    assert len(starts) == len(stops) == 2 and starts[0] < stops[0] < starts[1] < stops[1]
    deltas = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"]
    assert len(deltas) > 4
    message = accumulated(events)
    assert [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"] == [
        ("toolu_r1", "get_weather", {"city": "Oslo", "unit": "celsius"}),
        ("toolu_r1_1", "get_time", {"zone": "CET"})]
    assert message.stop_reason == "tool_use"


def test_calls_that_come_whole_with_the_final_event_are_sent_whole() -> None:
    events = anthropic_stream([], final())
    deltas = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"]
    assert [json.loads(d) for d in deltas] == [json.loads(a) for _i, _n, a in CALLS]
    assert [b.input for b in accumulated(events).content if b.type == "tool_use"] == [
        {"city": "Oslo", "unit": "celsius"}, {"zone": "CET"}]


def test_a_call_cut_short_by_the_length_ends_its_block() -> None:
    cut = pieces()[:3]  # the first call's name and two pieces of its arguments
    events = anthropic_stream(cut, final([], finish="length"))
    names = [name for name, _ in events]
    assert names.count("content_block_start") == names.count("content_block_stop") == 1
    assert names[-2:] == ["message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"


# The first call cut by max_tokens: its arguments as far as the model wrote them.
CUT = [(CALLS[0][0], CALLS[0][1], CALLS[0][2][:7])]


def test_a_cut_call_in_the_final_event_is_a_tool_use_block_of_what_was_written() -> None:
    # given a call streamed in part, then the final event with the cut call
    streamed = pieces()[:2]  # its name and first piece
    events = anthropic_stream(streamed, final(CUT, finish="length"))
    # then its block gets the rest of what was written, as written, and the stop is
    # max_tokens
    deltas = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"]
    assert "".join(deltas) == CUT[0][2]
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    [block] = accumulated(events).content  # the SDK reads it (its partial JSON parser)
    assert block.type == "tool_use" and block.name == "get_weather"
    # and a reply answered whole wraps the text that is not JSON, as Anthropic's docs
    # wrap invalid tool input
    assert [u["input"] for u in tool_uses(final(CUT, finish="length"))] == [
        {"INVALID_JSON": CUT[0][2]}]
    assert [u["input"] for u in tool_uses(final())] == [json.loads(a) for *_, a in CALLS]


def responses_stream(streamed: list[list[ToolDelta]], end: DoneEvent
                     ) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message["body"])

    async def run() -> dict[str, Any]:
        out = KeepAlive(send, 60)
        stream = EventStream(out, {"id": "resp_r1", "object": "response"}, "r1")
        try:
            for piece in streamed:
                stream.calls(piece)
                await out.flush()
            body = stream.end(end)
            stream.close(body)
            return body
        finally:
            await out.close()
            sent.append(out.take())

    body = asyncio.run(run())
    return frames(sent), body


def test_responses_sends_each_streamed_calls_arguments_in_pieces() -> None:
    events, body = responses_stream(pieces(), final())
    assert [d["sequence_number"] for _n, d in events] == list(range(len(events)))
    joined: dict[str, str] = {}
    for name, data in events:
        if name == "response.function_call_arguments.delta":
            joined[data["item_id"]] = joined.get(data["item_id"], "") + data["delta"]
    done = {d["item_id"]: d["arguments"] for n, d in events
            if n == "response.function_call_arguments.done"}
    assert joined == done == {"fc_r1_0": CALLS[0][2], "fc_r1_1": CALLS[1][2]}
    assert sum(n == "response.function_call_arguments.delta" for n, _ in events) > 4
    added = [d["output_index"] for n, d in events if n == "response.output_item.added"]
    assert added == [0, 1]
    assert [(o["call_id"], o["arguments"]) for o in body["output"]] == [
        (i, a) for i, _n, a in CALLS]
    assert body["status"] == "completed"


def test_responses_ends_a_cut_call_as_an_incomplete_item_of_what_was_written() -> None:
    # given a call streamed in part, then the final event with the cut call
    events, body = responses_stream(pieces()[:2], final(CUT, finish="length"))
    # then its argument deltas join into what was written, no `.done` claims them whole,
    # and its item is incomplete, as is the response (max_output_tokens)
    joined = "".join(d["delta"] for n, d in events
                     if n == "response.function_call_arguments.delta")
    assert joined == CUT[0][2]
    assert not [n for n, _ in events if n == "response.function_call_arguments.done"]
    [item] = body["output"]
    assert (item["status"], item["arguments"]) == ("incomplete", CUT[0][2])
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1][0] == "response.incomplete"
    # and a reply answered whole has the same item
    assert [(o["status"], o["arguments"]) for o in output(
        "r1", "", final(CUT, finish="length"))] == [("incomplete", CUT[0][2])]
