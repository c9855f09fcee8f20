"""Grammars for structured generation: tool calls and response formats, compiled by
llguidance (the engine vLLM and SGLang use), never by code of our own.

Torch-free: the gateway validates every schema with this before anything is queued
(llguidance checks a grammar without a tokenizer), and the worker compiles the same
grammar text into matchers (inference/constraint.py).

What a constrained reply looks like (the tool prompt tells the model the same):
- a tool call is `{"name": <a declared function>, "arguments": <its parameters>}`; with
  `parallel_tool_calls` several follow each other, each after TOOL_MARKER, up to
  MAX_PARALLEL_CALLS; in "auto" the model writes TOOL_MARKER to begin the first;
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
MAX_PARALLEL_CALLS = 8
MAX_SCHEMA_BYTES = 100_000
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                 "key_separator": ": ", "lenient": False}


class GrammarError(ValueError):
    """A schema (or tool list) that cannot be enforced; the message names what."""


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    strict: bool = False


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
    fmt = job.response_format
    return plan(tools=[Tool(t.name, t.parameters or {}, t.strict) for t in job.tools],
                choice=job.tool_choice, parallel=job.parallel_tool_calls,
                response_format=None if fmt is None else
                {"type": "json_object"} if fmt.type == "json_object" else
                {"schema": fmt.schema, "strict": fmt.strict})


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
        schema_grammar(tool.parameters or {"type": "object", "properties": {}},
                       strict=tool.strict, where=f"tools[{i}].function.parameters")
    # A named function is called once (as OpenAI's forced function is).
    several = parallel and choice in ("auto", "required")
    more = f' ("{TOOL_MARKER}" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if several else ""
    rules = [f"calls: call{more}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(chosen))),
             *(f"call_{i}: %json {json.dumps(_envelope(tool))}"
               for i, tool in enumerate(chosen))]
    if choice != "auto":
        top = "start: calls"
    elif answer is not None:
        top = f'start: answer | "{TOOL_MARKER}" calls'
        rules.append(f"answer: %json {json.dumps(_answer_schema(response_format))}")
    else:
        top = f'start: "{TOOL_MARKER}" calls'
    grammar = LLMatcher.grammar_from_lark("\n".join([top, *rules]))
    _validate(grammar, "tools")
    return Plan(grammar, watch_marker=choice == "auto" and answer is None, tools=True,
                calls_only=choice != "auto")


def split_calls(text: str) -> list[tuple[str, str]]:
    """(name, arguments as JSON) of each call in a finished constrained reply's text."""
    calls = []
    for part in text.split(TOOL_MARKER):
        if part.strip():
            envelope = json.loads(part)
            calls.append((envelope["name"], json.dumps(envelope["arguments"])))
    return calls


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
