"""Grammars for structured generation: tool calls and response formats, compiled by
llguidance (the engine vLLM and SGLang use), never by code of our own.

Torch-free: the gateway validates every schema with this before anything is queued
(llguidance checks a grammar without a tokenizer), and the worker compiles the same
grammar text into matchers (inference/structured/constraint.py).

What a constrained reply looks like (the tool prompt tells the model the same):
- a function call is `{"name": <a declared function>, "arguments": <its parameters>}`;
- a custom tool's call (free-form input) is `{"name": <the tool>}`, a newline, the raw
  input, then CUSTOM_END: `{"name": "apply_patch"}\n*** Begin Patch...</tool_input>`.
  The input is any text without CUSTOM_END (format "text"), a full match of the regex
  (syntax "regex", without CUSTOM_END), or a sentence of the Lark grammar (syntax
  "lark", compiled by llguidance as a nested grammar; an input of such a grammar ends at
  the first CUSTOM_END followed by the end of the reply or the next call);
- with `parallel_tool_calls` several calls follow each other, each after TOOL_MARKER, up
  to MAX_PARALLEL_CALLS; in "auto" the model writes TOOL_MARKER to begin the first;
- a response format is one JSON value of its schema (`json_object`: any JSON object);
- tools and a response format together: either the answer or TOOL_MARKER and calls.
JSON is written compactly as `json.dumps` does (", " and ": ", no other whitespace), so
the model is never offered meaningless whitespace.

Every keyword llguidance cannot enforce is a GrammarError naming it (its compiler is not
lenient); `strict` schemas must also follow OpenAI's strict rules.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llguidance import LLMatcher

from inference.jobs import ChatJob

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

TOOL_MARKER = "<tool_call>"  # how the model starts a tool call
CUSTOM_END = "</tool_input>"  # how the model ends a custom tool's input
MAX_DEFINITION_BYTES = 16 * 1024  # one custom tool's grammar
MAX_PARALLEL_CALLS = 8
MAX_SCHEMA_BYTES = 100_000
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                 "key_separator": ": ", "lenient": False}


class GrammarError(ValueError):
    """A schema (or tool list) that cannot be enforced; the message names what."""


@dataclass(frozen=True)
class Tool:
    """A function (`parameters`: its JSON schema) or, `kind` "custom", a tool of
    free-form input: `syntax` "" (any text), "lark" or "regex" with its `definition`."""

    name: str
    parameters: dict[str, Any]
    strict: bool = False
    kind: str = "function"
    syntax: str = ""
    definition: str = ""


@dataclass(frozen=True)
class Plan:
    """What constrains one reply: the grammar's text (llguidance's own format), and
    whether the model first chooses freely between text and a call (`watch_marker`:
    "auto" without a response format: the grammar starts at TOOL_MARKER, and only if
    the reply starts with it)."""

    grammar: str
    watch_marker: bool = False
    tools: bool = False
    calls_only: bool = False  # a call is required (or named): the reply is calls


def schema_grammar(schema: Any, *, strict: bool = False, where: str = "schema") -> str:
    """The grammar of one JSON value of `schema`, checked."""
    _check_schema(schema, strict=strict, where=where)
    grammar = LLMatcher.grammar_from_json_schema(whole_counts(schema), defaults=_JSON_OPTIONS)
    _validate(grammar, where)
    return grammar


def json_object_grammar() -> str:
    return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)


def job_plan(job: ChatJob) -> Plan | None:
    """The constraint of a chat job's reply (`plan` of its tools, tool choice and
    response format)."""
    return plan(**plan_args(job))


def plan_args(job: ChatJob) -> dict[str, Any]:
    """`plan`'s arguments for a chat job: its tools, tool choice and response format."""
    fmt = job.response_format
    return {"tools": [Tool(t.name, t.parameters or {}, t.strict, t.kind, t.syntax,
                           t.definition) for t in job.tools],
            "choice": job.tool_choice, "parallel": job.parallel_tool_calls,
            "response_format": None if fmt is None else
            {"type": "json_object"} if fmt.type == "json_object" else
            {"schema": fmt.schema, "strict": fmt.strict}}


def plan(*, tools: Sequence[Tool] = (), choice: str = "auto", parallel: bool = True,
         response_format: dict[str, Any] | None = None) -> Plan | None:
    """The constraint of a reply, or None when it is free text. `choice`: "auto",
    "required", or a function's name (which must be among `tools`; called once);
    `response_format`: {"schema": ..., "strict": bool} or {"type": "json_object"}."""
    answer = None
    if response_format is not None:
        if response_format.get("type") == "json_object":
            answer = json_object_grammar()
        else:
            answer = schema_grammar(response_format.get("schema"),
                                    strict=bool(response_format.get("strict")),
                                    where="response_format.json_schema.schema")
    if not tools:
        return Plan(answer) if answer is not None else None
    chosen = list(tools) if choice in ("auto", "required") else [
        t for t in tools if t.name == choice]
    if not chosen:
        raise GrammarError(f"tool_choice names '{choice}', which is not among the tools")
    for i, tool in enumerate(tools):
        if tool.kind == "custom":
            _check_custom(tool, where=f"tools[{i}].format")
        elif tool.kind == "function":
            schema_grammar(tool.parameters or {"type": "object", "properties": {}},
                           strict=tool.strict, where=f"tools[{i}].function.parameters")
        else:
            raise GrammarError(f"tools[{i}].type: unknown tool kind '{tool.kind}'")
    # A named function is called once (as OpenAI's forced function is).
    several = parallel and choice in ("auto", "required")
    more = f' ("{TOOL_MARKER}" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if several else ""
    rules = [f"calls: call{more}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(chosen))),
             *(_call_rules(i, tool, mixed=any(t.kind == "custom" for t in chosen))
               for i, tool in enumerate(chosen))]
    if choice != "auto":
        top = "start: calls"
    elif answer is not None:
        top = f'start: answer | "{TOOL_MARKER}" calls'
        rules.append(f"answer: %json {json.dumps(_answer_schema(response_format))}")
    else:
        top = f'start: "{TOOL_MARKER}" calls'
    grammar = LLMatcher.grammar_from_lark("\n".join([top, *rules]))
    nested = [{"name": f"custom_{i}", "lark_grammar": tool.definition}
              for i, tool in enumerate(chosen) if tool.kind == "custom"
              and tool.syntax == "lark"]
    if nested:  # the Lark tools' grammars are their own, referenced as @custom_<i>
        grammar = json.dumps({"grammars": [{"lark_grammar": grammar}, *nested]})
    _validate(grammar, "tools")
    return Plan(grammar, watch_marker=choice == "auto" and answer is None, tools=True,
                calls_only=choice != "auto")


def split_calls(text: str) -> list[tuple[str, str]]:
    """(name, arguments) of each call in a finished constrained reply's text: a
    function's arguments as JSON, a custom tool's raw input. ValueError when the text
    is not calls."""
    calls: list[tuple[str, str]] = []
    pos = _after_marker(text, 0)
    while True:
        envelope, pos = _decoder.raw_decode(text, len(text) - len(text[pos:].lstrip()))
        if not isinstance(envelope, dict) or not isinstance(envelope.get("name"), str):
            raise ValueError("a call without a name")
        if "arguments" in envelope:
            calls.append((envelope["name"], json.dumps(envelope["arguments"])))
        elif set(envelope) == {"name"} and text.startswith("\n", pos):
            start = pos + 1
            stop = _input_end(text, start)
            calls.append((envelope["name"], text[start:stop]))
            pos = stop + len(CUSTOM_END)
        else:
            raise ValueError("a call of neither shape")
        if not text[pos:].strip():
            return calls
        pos = _after_marker(text, pos)


def call_text(name: str, arguments: str, *, custom: bool = False) -> str:
    """One call as the model writes it (without TOOL_MARKER): `arguments` is JSON text
    for a function, the raw input for a custom tool."""
    if custom:
        return f'{{"name": {json.dumps(name)}}}\n{arguments}{CUSTOM_END}'
    return f'{{"name": {json.dumps(name)}, "arguments": {arguments}}}'


_decoder = json.JSONDecoder()


def _after_marker(text: str, pos: int) -> int:
    """Past the whitespace and TOOL_MARKER at `pos` (ValueError without the marker,
    except before the first call of a reply that was forced to call)."""
    rest = text[pos:].lstrip()
    if rest.startswith(TOOL_MARKER):
        return len(text) - len(rest) + len(TOOL_MARKER)
    if pos == 0:
        return len(text) - len(rest)
    raise ValueError("calls not separated by the marker")


def _input_end(text: str, start: int) -> int:
    """Where a custom input that begins at `start` ends: the first CUSTOM_END followed by
    the end of the text or the next call (the input's own grammar may allow the marker
    inside it)."""
    stop = text.find(CUSTOM_END, start)
    first = stop
    while stop >= 0:
        rest = text[stop + len(CUSTOM_END):]
        if not rest.strip() or rest.lstrip().startswith(TOOL_MARKER + '{"name": '):
            return stop
        stop = text.find(CUSTOM_END, stop + 1)
    if first < 0:
        raise ValueError("a custom tool's input without its end")
    return first


_COUNTS = frozenset({"maxLength", "minLength", "maxItems", "minItems", "maxProperties",
                     "minProperties"})


def whole_counts(schema: Any) -> Any:
    """`schema` with counts written as whole floats (20.0: gRPC's Struct carries every
    number as a double) made integers; any other value is left for the compiler."""
    if isinstance(schema, list):
        return [whole_counts(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {key: int(value) if key in _COUNTS and isinstance(value, float)
            and value.is_integer() else whole_counts(value) if key not in (
                "const", "enum", "default", "examples") else value
            for key, value in schema.items()}


def _envelope(tool: Tool) -> dict[str, Any]:
    """`{"name": <the tool's>, "arguments": <its parameters>}` as one JSON schema (its own
    document in the grammar, so the parameters' local `$ref`s are rebased into it)."""
    parameters = tool.parameters or {"type": "object", "properties": {}}
    return {"type": "object", "additionalProperties": False,
            "required": ["name", "arguments"],
            "properties": {"name": {"const": tool.name},
                           "arguments": _rebase(whole_counts(parameters),
                                                "/properties/arguments")},
            "x-guidance": dict(_JSON_OPTIONS)}


def _call_rules(i: int, tool: Tool, *, mixed: bool) -> str:
    """The grammar rules of a call of `tool` (the i-th chosen). Beside custom tools
    (`mixed`) a function's envelope is literal text around its parameters' grammar: the
    lexer then tells every call's beginning apart (a nested JSON grammar beside literal
    text is not)."""
    if tool.kind != "custom" and not mixed:
        return f"call_{i}: %json {json.dumps(_envelope(tool))}"
    if tool.kind != "custom":
        parameters = tool.parameters or {"type": "object", "properties": {}}
        head = json.dumps(call_text(tool.name, "")[:-1])
        schema = {**whole_counts(parameters), "x-guidance": dict(_JSON_OPTIONS)}
        return f'call_{i}: {head} %json {json.dumps(schema)} "}}"'
    head = json.dumps(call_text(tool.name, "", custom=True)[:-len(CUSTOM_END)])
    if tool.syntax == "lark":
        return f"call_{i}: {head} @custom_{i} {json.dumps(CUSTOM_END)}"
    # The input and its end are one lexeme: the text up to the first CUSTOM_END.
    body = "(?s:.*)" if tool.syntax == "" else f"(?:{_lark_regex(_unanchored(tool.definition))})"
    end = _lark_regex(CUSTOM_END)
    return f"call_{i}: {head} CUSTOM_{i}\nCUSTOM_{i}: /{body}{end}/ & ~/(?s:.*){end}(?s:.+)/"


def _check_custom(tool: Tool, *, where: str) -> None:
    """A custom tool's grammar, compiled alone; GrammarError naming `where`."""
    if tool.syntax not in ("", "lark", "regex"):
        raise GrammarError(f"{where}.syntax: unknown grammar syntax '{tool.syntax}'")
    if tool.syntax and not tool.definition.strip():
        raise GrammarError(f"{where}.definition: the grammar is empty")
    if len(tool.definition.encode()) > MAX_DEFINITION_BYTES:
        raise GrammarError(f"{where}.definition is larger than {MAX_DEFINITION_BYTES} bytes")
    if tool.syntax == "lark":
        _validate(tool.definition, where)
    elif tool.syntax == "regex":
        _validate(f"start: /{_lark_regex(_unanchored(tool.definition))}/", where)


def _unanchored(pattern: str) -> str:
    """A regex without a leading `^` or trailing `$` (the input is matched whole)."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and (len(pattern) - len(pattern[:-1].rstrip("\\")) - 1) % 2 == 0:
        pattern = pattern[:-1]
    return pattern


def _lark_regex(pattern: str) -> str:
    """`pattern` as the body of a Lark regex literal (`/.../`): slashes and line breaks
    escaped, other escapes kept."""
    out, escaped = [], False
    for char in pattern:
        if escaped:
            out.append(char)
            escaped = False
        elif char == "\\":
            out.append(char)
            escaped = True
        elif char == "/":
            out.append("\\/")
        elif char in "\n\r":
            out.append("\\n" if char == "\n" else "\\r")
        else:
            out.append(char)
    return "".join(out)


def _rebase(schema: Any, prefix: str) -> Any:
    """`schema` with every local `$ref` ("#...") pointing `prefix` deeper."""
    if isinstance(schema, list):
        return [_rebase(item, prefix) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _rebase(value, prefix) if key not in ("const", "enum", "default",
                                                      "examples") else value
           for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = "#" + prefix + ref[1:]
    return out


def _answer_schema(response_format: dict[str, Any] | None) -> dict[str, Any]:
    fmt = response_format or {}
    schema = {"type": "object"} if fmt.get("type") == "json_object" else \
        whole_counts(fmt["schema"])
    return {**schema, "x-guidance": dict(_JSON_OPTIONS)}


def _validate(grammar: str, where: str) -> None:
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"{where}: {_plain(messages[0] if messages else 'invalid')}")


def _plain(message: str) -> str:
    """llguidance's message without its internal context lines."""
    return message.strip().splitlines()[0][:300]


def _check_schema(schema: Any, *, strict: bool, where: str) -> None:
    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be a JSON schema object")
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"{where} is larger than {MAX_SCHEMA_BYTES} bytes")
    if strict:
        problem = _strict_problem(schema, where)
        if problem:
            raise GrammarError(problem)


def _strict_problem(schema: Any, where: str) -> str | None:
    """OpenAI's strict-mode rules: every object lists all its properties as required
    and sets additionalProperties to false (in $defs and nested schemas too)."""
    if isinstance(schema, list):
        return next((p for i, s in enumerate(schema)
                     if (p := _strict_problem(s, f"{where}[{i}]"))), None)
    if not isinstance(schema, dict):
        return None
    props = schema.get("properties")
    if schema.get("type") == "object" or isinstance(props, dict):
        if schema.get("additionalProperties", True) is not False:
            return f"{where}: strict schemas must set additionalProperties to false"
        missing = sorted(set(props or {}) - set(schema.get("required") or []))
        if missing:
            return f"{where}: strict schemas must list every property in required " \
                   f"(missing '{missing[0]}')"
    for key, sub in schema.items():
        if key in ("properties", "$defs", "definitions") and isinstance(sub, dict):
            for name, inner in sub.items():
                if (p := _strict_problem(inner, f"{where}.{key}.{name}")):
                    return p
        elif key in ("items", "anyOf", "oneOf", "allOf", "prefixItems",
                     "additionalProperties") and isinstance(sub, dict | list) \
                and (p := _strict_problem(sub, f"{where}.{key}")):
            return p
    return None
