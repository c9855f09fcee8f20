"""Tool calls read while they are written: the calls begun so far in the text of a reply
generated under a tools grammar (inference/structured/grammar.py), so the output processor can
stream each call's arguments (a custom tool's input) as the model writes them (OpenAI's
and Anthropic's streams do) and end with exactly the text it streamed.

The grammar writes calls separated by TOOL_MARKER (before the first one too in an
"auto" reply), read one after another from the start (an input may hold the marker):
- a function's `{"name": <name>, "arguments": <JSON value>}` with no whitespace but
  ", " and ": " (`whitespace_flexible` off), name first: listed from the moment its
  name is complete; its `arguments` is the value's text so far, all of which belongs
  to the value until the value is complete (only then can a `}` be the envelope's);
- a custom tool's `{"name": <name>}`, a newline, the raw input and CUSTOM_END: listed
  once the newline is written; its `arguments` is the input so far, less a tail that
  may be the start of CUSTOM_END (held back until the next characters say), complete
  at the first CUSTOM_END.
A part that is not of either shape ends the reading: those calls then arrive whole with
the final event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from inference.structured.grammar import CUSTOM_END, TOOL_MARKER

_NAME = '{"name": '
_ARGUMENTS = ', "arguments": '
_INPUT = "}\n"  # after a custom tool's name: its input follows
_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class CallText:
    name: str
    arguments: str  # the arguments' JSON text (a custom input) so far; all once complete
    complete: bool
    custom: bool = False  # a custom tool's call: `arguments` is its raw input


def read_calls(text: str) -> list[CallText]:
    """The calls begun in `text`, in order (see the module's docstring)."""
    out: list[CallText] = []
    pos = len(text) - len(text.lstrip())  # what an "auto" reply wrote before its marker
    if text.startswith(TOOL_MARKER, pos):
        pos += len(TOOL_MARKER)
    while text.startswith(_NAME, pos):
        try:
            name, end = _decoder.raw_decode(text, pos + len(_NAME))
        except ValueError:
            break  # the name is still being written
        if not isinstance(name, str):
            break
        if text.startswith(_ARGUMENTS, end):
            start = end + len(_ARGUMENTS)
            try:
                _value, stop = _decoder.raw_decode(text, start)
            except ValueError:
                out.append(CallText(name, text[start:], complete=False))
                break  # a call is written to its end before the next begins
            out.append(CallText(name, text[start:stop], complete=True))
            pos = stop + 1  # the envelope's "}"
        elif text.startswith(_INPUT, end):
            start = end + len(_INPUT)
            stop = text.find(CUSTOM_END, start)
            if stop < 0:
                out.append(CallText(name, _held_back(text[start:]), complete=False,
                                    custom=True))
                break
            out.append(CallText(name, text[start:stop], complete=True, custom=True))
            pos = stop + len(CUSTOM_END)
        else:
            break
        if not text.startswith(TOOL_MARKER, pos):
            break
        pos += len(TOOL_MARKER)
    return out


def _held_back(written: str) -> str:
    """`written` less its longest tail that begins CUSTOM_END."""
    for n in range(min(len(CUSTOM_END) - 1, len(written)), 0, -1):
        if written.endswith(CUSTOM_END[:n]):
            return written[:-n]
    return written
