"""Generated frames against /v1/realtime (the WebSocket adapter) over a real socket to the
live server, as a developer: Schemathesis covers the documented HTTP operations, and
this covers the frames the WebSocket protocol takes (streaming/transports/websocket.py).

Whatever the frame: an answer, never silence and never a server error. A frame with an
id (1-64 characters) gets that id's final frame (`chat.done`, `embeddings.result` or an
`error` carrying an OpenAI error body with a 4XX code); any other frame gets an `error`
frame without an id. The socket stays open throughout, and a valid request still runs
after all of it. Derandomized: the same frames every run; SLUICE_FUZZ_EXAMPLES_WS
(default 60 sessions of up to four frames) explores further. A frame that goes
unanswered fails its example after 15 s."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live

EXAMPLES = int(os.environ.get("SLUICE_FUZZ_EXAMPLES_WS", "60"))
FINAL = ("chat.done", "embeddings.result", "error")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "dancer"]),
     "content": st.one_of(st.text(max_size=30), json_values)}), max_size=3)
chat_requests = st.fixed_dictionaries(
    {"model": st.sampled_from(["echo", "minilm", "nope", ""]), "messages": messages},
    optional={"max_tokens": json_values | st.integers(-5, 50),
              "temperature": json_values | st.floats(-1, 3),
              "stop": json_values, "tools": json_values, "tool_choice": json_values,
              "stream_options": json_values, "n": st.integers(-1, 3),
              "response_format": json_values})
embedding_requests = st.fixed_dictionaries(
    {"model": st.sampled_from(["minilm", "echo", "nope"]),
     "input": st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3),
                        json_values)})
frames = st.one_of(
    st.fixed_dictionaries({
        "type": st.sampled_from(["chat.request", "embeddings.request"]),
        "id": st.text(min_size=1, max_size=64),
        "request": st.one_of(chat_requests, embedding_requests, json_values)}),
    st.fixed_dictionaries({"type": json_values, "id": json_values, "request": json_values}),
    json_values,
).map(lambda frame: json.dumps(frame, allow_nan=False))


async def _answer(ws: Any, frame: str) -> list[dict[str, Any]]:
    """Send `frame`; the frames up to its final one (or the id-less error)."""
    sent = json.loads(frame)
    rid = sent.get("id") if isinstance(sent, dict) else None
    valid_id = isinstance(rid, str) and 0 < len(rid) <= 64
    await ws.send(frame)
    out: list[dict[str, Any]] = []
    while True:
        reply = json.loads(await asyncio.wait_for(ws.recv(), 15))
        out.append(reply)
        # A chat request's last frame is the chat.done with its usage (one per choice).
        if reply["type"] in FINAL and reply.get("id") == (rid if valid_id else None) \
                and (reply["type"] != "chat.done" or "usage" in reply):
            return out


def _check(frame: str, replies: list[dict[str, Any]]) -> None:
    final = replies[-1]
    if final["type"] == "error":
        error = final["error"]
        assert isinstance(error.get("message"), str) and error["message"], (frame, final)
        assert error.get("type") != "server_error", (frame, final)
        code = error.get("code")
        assert code is None or isinstance(code, str), (frame, final)


@pytest.mark.slow
def test_generated_frames_get_typed_answers_and_the_socket_stays(live: Live) -> None:
    org = make_org("wsfuzz", [Role.DEVELOPER])
    url = live.base_url.replace("http://", "ws://") + "/realtime"
    key = org.keys[Role.DEVELOPER]

    async def session(generated: list[str]) -> None:
        async with websockets.connect(url, additional_headers={
                "Authorization": f"Bearer {key}"}, max_size=2**24) as ws:
            for frame in generated:
                if '"cancel"' in frame:
                    continue  # a cancel is answered by the request it cancels, if any
                _check(frame, await _answer(ws, frame))
            done = await _answer(ws, json.dumps({"type": "chat.request", "id": "after", "request": {
                "model": "echo", "messages": [{"role": "user", "content": "still"}]}}))
            assert done[-1]["type"] == "chat.done"
            assert "".join(f.get("delta", "") for f in done) == "still"

    @given(generated=st.lists(frames, min_size=1, max_size=4))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(generated: list[str]) -> None:
        asyncio.run(session(generated))

    run()


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.slow
def test_deeply_nested_frames_get_error_frames_and_the_socket_stays(live: Live) -> None:
    """Given a developer's socket, when frames nest JSON far deeper than any request
    needs (100,000 `[` unclosed, closed, and nesting inside a request's fields, deep
    enough to pass a depth-limited parser and break a recursive encoder downstream),
    then each gets a typed 400 error frame (an id-less one for a frame that is not a
    JSON object, the request's own for a request), and the socket then still serves a
    request."""
    org = make_org("wsdeep", [Role.DEVELOPER])
    url = live.base_url.replace("http://", "ws://") + "/realtime"
    # (frame, the id its error frame carries): None for what is not a JSON object.
    sent: list[tuple[str, str | None]] = [
        ("[" * 100_000, None), (_nested(100_000), None),
        ('{"type": "chat.request", "id": "x", "request": ' + "[" * 100_000 + "}", None)]
    for depth in (100, 300, 900):
        # The nesting goes in as text: the test's own json would recurse on it.
        for rid, template in (
                (f"c{depth}", {"type": "chat.request", "id": f"c{depth}", "request": {
                    "model": "echo", "messages": [{"role": "user", "content": [
                        {"x": "DEEP"}]}]}}),
                (f"t{depth}", {"type": "chat.request", "id": f"t{depth}", "request": {
                    "model": "echo", "messages": [{"role": "user", "content": "hi"}],
                    "tools": [{"type": "function", "function": {
                        "name": "f", "parameters": {"type": "object", "x": "DEEP"}}}]}}),
                (f"y{depth}", {"type": "DEEP", "id": f"y{depth}"})):
            sent.append((json.dumps(template).replace('"DEEP"', _nested(depth)), rid))

    async def go() -> list[dict[str, Any]]:
        async with websockets.connect(url, additional_headers={
                "Authorization": f"Bearer {org.keys[Role.DEVELOPER]}"}, max_size=2**24) as ws:
            finals = []
            for frame, rid in sent:
                await ws.send(frame)
                while (reply := json.loads(await asyncio.wait_for(ws.recv(), 15)))[
                        "type"] not in FINAL or reply.get("id") != rid:
                    pass
                finals.append(reply)
            after = await _answer(ws, json.dumps({
                "type": "chat.request", "id": "after", "request": {
                    "model": "echo", "messages": [{"role": "user", "content": "still"}]}}))
            return [*finals, {"after": after}]
    *finals, after = asyncio.run(go())
    for (frame, _), final in zip(sent, finals, strict=True):
        assert final["type"] == "error", (frame[:80], final)
        assert final["error"]["type"] == "invalid_request_error", (frame[:80], final)
    assert after["after"][-1]["type"] == "chat.done"
    assert "".join(f.get("delta", "") for f in after["after"]) == "still"
