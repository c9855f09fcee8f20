"""Tool calls read while they are written: the calls begun so far in the text of a reply
generated under a tools grammar (inference/grammar.py), so the output processor can
stream each call's arguments as the model writes them (OpenAI's and Anthropic's
streams do) and end with exactly the text it streamed.

The grammar writes calls separated by TOOL_MARKER (before the first one too in an
"auto" reply), each `{"name": <name>, "arguments": <JSON value>}` with no whitespace but
", " and ": " (`whitespace_flexible` off), name first. A call is listed from the moment
its name is complete; its `arguments` is the value's text so far, all of which belongs
to the value until the value is complete (only then can a `}` be the envelope's). A part
that is not of that shape ends the reading: those calls then arrive whole with the
final event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from inference.grammar import TOOL_MARKER

_NAME = '{"name": '
_ARGUMENTS = ', "arguments": '
_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class CallText:
    name: str
    arguments: str  # the arguments' JSON text so far (all of it once `complete`)
    complete: bool


def read_calls(text: str) -> list[CallText]:
    """The calls begun in `text`, in order (see the module's docstring)."""
    out: list[CallText] = []
    for part in text.split(TOOL_MARKER):
        if not part.strip():
            continue  # what an "auto" reply wrote before its first marker
        if not part.startswith(_NAME):
            break
        try:
            name, end = _decoder.raw_decode(part, len(_NAME))
        except ValueError:
            break  # the name is still being written
        if not isinstance(name, str) or not part.startswith(_ARGUMENTS, end):
            break
        start = end + len(_ARGUMENTS)
        try:
            _value, stop = _decoder.raw_decode(part, start)
        except ValueError:
            out.append(CallText(name, part[start:], complete=False))
            break  # a call is written to its end before the next begins
        out.append(CallText(name, part[start:stop], complete=True))
    return out
