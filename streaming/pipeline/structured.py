"""Tools and response formats of a call request, checked at the gateway: what the worker
gets to build the reply's grammar (inference/structured/grammar.py), and the system prompt that
tells the model how to write a call. `structured_body` takes the request's structure
(cheap checks only, the structural pre-check of its schemas included);
`check_grammar`, after the call's admission, compiles its grammar
in a bounded child process (inference/structured/grammar_check.py). Errors name the call's
neutral parameters (streaming/pipeline/callrequest.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from inference.jobs import ChatJob, ToolSpec
from inference.structured import grammar
from inference.structured.grammar import CUSTOM_END, TOOL_MARKER, call_text
from inference.structured.grammar_check import (
    GrammarChecker,
    GrammarUnavailable,
    PlanRequest,
    TooComplex,
    precheck,
)
from sluice.errors import BadRequest, Unavailable
from streaming.pipeline.callrequest import CallRequest, ParamError


def tool_prompt(tools: list[ToolSpec], *, parallel: bool) -> list[dict[str, str]]:
    """The messages that go before the caller's: the tools and how to call them, and
    one worked exchange (a call of the first tool). Small models follow an example
    far better than an instruction: SmolLM2-135M answers a weather question with a call
    only when it has seen one; with it, it still answers other questions in text.

    A function's call is TOOL_MARKER and `{"name": ..., "arguments": ...}`; a custom
    tool's is TOOL_MARKER, `{"name": ...}`, a newline, the raw input and CUSTOM_END
    (inference/structured/grammar.py; the grammar, not this prompt, holds the model to it)."""
    functions = [{"name": t.name, "description": t.description,
                  "parameters": t.parameters or {}} for t in tools if t.kind != "custom"]
    custom = [{"name": t.name, "description": t.description,
               **({"grammar": {"syntax": t.syntax, "definition": t.definition}}
                  if t.syntax else {})} for t in tools if t.kind == "custom"]
    several = (" To call several, write each call the same way, one after another."
               if parallel else "")
    how = []
    if functions:
        how.append("You can call functions. When a function can answer the user's question, "
                   f"reply with {TOOL_MARKER} followed by a JSON object "
                   '{"name": <function name>, "arguments": <arguments>} and nothing else.'
                   + several + " Functions: " + json.dumps(functions))
    if custom:
        how.append(f"You can call tools that take free-form input: reply with {TOOL_MARKER}"
                   ' followed by {"name": <tool name>}, a new line, the input as plain text '
                   f"(matching the tool's grammar, if it has one), then {CUSTOM_END} and "
                   "nothing else." + ("" if functions else several)
                   + " Tools with free-form input: " + json.dumps(custom))
    first = tools[0]
    example = call_text(first.name, "example", custom=True) if first.kind == "custom" \
        else call_text(first.name, json.dumps(_example_arguments(first.parameters or {})))
    return [
        {"role": "system", "content": " ".join(how)},
        {"role": "user", "content": "Can you check something with a function?"},
        {"role": "assistant", "content": TOOL_MARKER + example},
    ]


def _example_arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """Plausible-looking arguments for the example call: the first required properties
    with a value of their type (the grammar, not this, makes real calls valid)."""
    found = schema.get("properties")
    props: dict[str, Any] = found if isinstance(found, dict) else {}
    required = [r for r in schema.get("required") or [] if r in props][:2]
    out: dict[str, Any] = {}
    for name in required:
        sub = props[name] if isinstance(props[name], dict) else {}
        kind = sub.get("type")
        if isinstance(sub.get("enum"), list) and sub["enum"]:
            out[name] = sub["enum"][0]
        else:
            out[name] = {"integer": 1, "number": 1.5, "boolean": True, "array": [],
                         "object": {}}.get(kind if isinstance(kind, str) else "", "example")
    return out


def structured_body(req: CallRequest) -> ChatJob:
    """A job with the request's tools, tool choice, parallel_tool_calls and response
    format (all defaults for a free-text reply), checked (names unique, a named choice
    among them, the structural pre-check of the schemas); its grammar is not compiled
    yet (`check_grammar`). The call's jobs copy these fields."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise ParamError("", "tool_choice", " is set but no tools are given.", code=None)
        job = ChatJob(response_format=req.response_format)
    elif choice != "none":
        names = [t.name for t in req.tools]
        if len(set(names)) != len(names):
            raise BadRequest("Function names must be unique.", param="tools")
        wanted = req.tool_name or "" if choice == "function" else choice or "auto"
        if choice == "function" and wanted not in names:
            raise ParamError("", "tool_choice", f" names '{wanted}', which is not among the "
                             "tools.", code=None)
        job = ChatJob(response_format=req.response_format, tools=req.tools,
                      tool_choice=wanted, parallel_tool_calls=req.parallel_tool_calls)
    else:
        job = ChatJob(response_format=req.response_format)
    if job.constrained:
        with _refused():
            precheck(PlanRequest.of(job))
    return job


async def check_grammar(job: ChatJob, *, checker: GrammarChecker, tenant: str) -> None:
    """Compile the job's grammar as the worker will, off the event loop and bounded: a
    400 naming what cannot be enforced (`schema_too_complex` when deciding it would cost
    more than the checker's budget), a retriable 503 when no checker could start."""
    if not job.constrained:
        return
    with _refused():
        await checker.check(PlanRequest.of(job), tenant=tenant)


@contextlib.contextmanager
def _refused() -> Iterator[None]:
    """A grammar's refusal as the caller's 400 naming where (or a retriable 503)."""
    try:
        yield
    except TooComplex as exc:
        where, rest = _where(exc)
        raise ParamError("Schema too complex: ", where, rest,
                         code="schema_too_complex") from None
    except grammar.GrammarError as exc:
        where, rest = _where(exc)
        raise ParamError("Invalid schema: ", where, rest,
                         code="invalid_function_parameters" if where.startswith("tools")
                         else "invalid_response_format") from None
    except GrammarUnavailable:
        raise Unavailable("The schema checker is unavailable; try again shortly.",
                          code="schema_checker_unavailable",
                          headers={"Retry-After": "1"}) from None


# The grammar names places by Chat Completions' fields; the call's neutral names.
_FORMAT, _PARAMETERS = "response_format.json_schema", ".function.parameters"


def _where(exc: grammar.GrammarError) -> tuple[str, str]:
    """(the neutral name of what `exc` is about, the rest of its message)."""
    text = str(exc)
    where = text.split(":")[0]
    rest = text[len(where):]
    if where.startswith(_FORMAT):
        return "response_format" + where[len(_FORMAT):], rest
    if where.startswith("tools[") and _PARAMETERS in where:
        return where.replace(_PARAMETERS, ".parameters", 1), rest
    return where, rest
