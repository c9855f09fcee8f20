"""Reading tool calls while they are written (inference/structured/toolstream.py): every
prefix of a reply's text gives calls whose arguments only grow, and the whole text
gives each call's arguments exactly as written."""

from __future__ import annotations

import json

from inference.structured.grammar import TOOL_MARKER
from inference.structured.toolstream import CallText, read_calls

FIRST = '{"name": "get_weather", "arguments": {"city": "Zürich}", "days": [1, 2]}}'
SECOND = '{"name": "noop", "arguments": {}}'


def test_every_prefix_grows_the_calls_and_the_whole_text_gives_them_as_written() -> None:
    # given an "auto" reply (a marker before each call) written character by character
    text = f" {TOOL_MARKER}{FIRST}{TOOL_MARKER}{SECOND}"
    seen: list[CallText] = []
    for n in range(len(text) + 1):
        calls = read_calls(text[:n])
        # then no call's arguments ever shrink or change what was read before
        assert len(calls) >= len(seen)
        for before, now in zip(seen, calls, strict=False):
            assert now.name == before.name and now.arguments.startswith(before.arguments)
        seen = calls
    # and the whole text has both calls complete, their arguments as written
    assert seen == [CallText("get_weather", '{"city": "Zürich}", "days": [1, 2]}', True),
                    CallText("noop", "{}", True)]
    assert json.loads(seen[0].arguments) == json.loads(FIRST)["arguments"]


def test_a_call_is_listed_once_its_name_is_complete() -> None:
    # given a forced call (no marker before it) cut inside its name, then after it
    assert read_calls('{"name": "get_wea') == []
    assert read_calls('{"name": "get_weather", "argu') == []
    assert read_calls('{"name": "get_weather", "arguments": ') == [
        CallText("get_weather", "", False)]


def test_text_of_another_shape_is_not_read() -> None:
    assert read_calls('{"arguments": {}, "name": "f"}') == []
    assert read_calls("plain text") == []
