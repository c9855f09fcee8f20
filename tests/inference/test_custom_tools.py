"""Custom tools (free-form input, the Responses API's `custom` tools) on llguidance:
Lark and regex grammars compile as calls, alone and beside functions; a grammar that
cannot be compiled is refused naming the tool; the random-weights model's inputs always
parse with the tool's own grammar; calls are split and streamed as (name, raw input);
the gateway's precheck bounds the grammars' size."""

from __future__ import annotations

import json
import re
from typing import Any, cast

import pytest
from llguidance import LLMatcher, LLTokenizer

from inference.jobs import ChatJob, ToolSpec
from inference.runtimes.causal_lm import CausalLMRuntime
from inference.structured.constraint import Constraint, Vocabulary
from inference.structured.grammar import (
    CUSTOM_END,
    TOOL_MARKER,
    GrammarError,
    Tool,
    job_plan,
    plan,
    split_calls,
)
from inference.structured.grammar_check import (
    MAX_TOTAL_DEFINITION_BYTES,
    PlanRequest,
    TooComplex,
    precheck,
)
from inference.structured.toolstream import CallText, read_calls
from streaming.pipeline.structured import tool_prompt
from tests.inference.test_grammar import generate, tiny, vocab  # noqa: F401 (fixtures)

ADD = Tool("add", {}, kind="custom", syntax="lark",
           definition='start: "add " NUMBER " " NUMBER\n%import common.NUMBER')
PATCH = Tool("apply_patch", {}, kind="custom", syntax="lark", definition="""
start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch"
hunk: "*** Update File: " FILENAME LF change+
change: ("+" | "-" | " ") LINE LF
FILENAME: /[a-z_]{1,12}\\.py/
LINE: /[a-z =()]{0,20}/
LF: "\\n"
""")
CODE = Tool("ticket", {}, kind="custom", syntax="regex", definition=r"^[A-Z]{2,4}-\d{1,4}$")
FREE = Tool("note", {}, kind="custom")
WEATHER = Tool("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False})


def accepts(tool: Tool, text: str) -> bool:
    """The tool's own grammar (compiled alone, no tokenizer) matches `text` whole."""
    grammar = tool.definition if tool.syntax == "lark" else \
        f"start: /{tool.definition.strip('^$')}/"
    matcher = LLMatcher(_bytes_tokenizer(), grammar, log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def _bytes_tokenizer() -> LLTokenizer:
    return LLTokenizer("byte")  # one token per byte


@pytest.mark.parametrize("tool", [ADD, PATCH, CODE, FREE])
def test_a_custom_tool_compiles_forced_auto_and_beside_functions(tool: Tool) -> None:
    for tools, choice in (([tool], tool.name), ([tool], "auto"), ([tool], "required"),
                          ([WEATHER, tool, FREE], "auto"), ([tool, WEATHER], tool.name)):
        found = plan(tools=tools, choice=choice)
        assert found is not None and found.tools
        assert found.calls_only == (choice != "auto")


@pytest.mark.parametrize(("tool", "message"), [
    (Tool("bad", {}, kind="custom", syntax="lark", definition="start: undefined_rule"),
     "tools[1].format"),
    (Tool("bad", {}, kind="custom", syntax="regex", definition="[a-"), "tools[1].format"),
    (Tool("bad", {}, kind="custom", syntax="ebnf", definition="x"), "tools[1].format.syntax"),
    (Tool("bad", {}, kind="custom", syntax="lark", definition=" "),
     "tools[1].format.definition"),
    (Tool("bad", {}, kind="custom", syntax="lark", definition="x" * 20_000),
     "tools[1].format.definition"),
    (Tool("bad", {}, kind="webhook"), "tools[1].type"),
])
def test_a_grammar_that_cannot_compile_is_refused_naming_the_tool(tool: Tool,
                                                                 message: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(message)):
        plan(tools=[WEATHER, tool])


def test_tool_choice_naming_an_unknown_custom_tool_is_refused() -> None:
    with pytest.raises(GrammarError, match="tool_choice"):
        plan(tools=[ADD], choice="nope")


@pytest.mark.parametrize("seed", [0, 100, 200])
def test_inputs_the_model_writes_always_parse_with_the_tools_grammar(
        tiny: CausalLMRuntime, vocab: Vocabulary, seed: int) -> None:  # noqa: F811
    """Given each custom tool forced, when the random-weights model writes many calls
    (sampled, many seeds), then every input is complete and its own grammar (compiled
    alone) accepts it."""
    tools = [ADD, PATCH, CODE, FREE]
    plans = {tool.name: plan(tools=[WEATHER, *tools], choice=tool.name) for tool in tools}
    rows = [(tool, Constraint(vocab, found, budget=160)) for tool in tools
            for _ in range(4) if (found := plans[tool.name]) is not None]
    generate(tiny, [c for _t, c in rows], temperature=1.0, seed=seed, budget=160)
    failures = []
    for tool, constraint in rows:
        if not constraint.complete and not constraint.matcher.is_accepting():
            if tool is FREE or tool is PATCH:
                continue  # unbounded inputs may run out of budget: never invalid
            failures.append(f"{tool.name}: incomplete {constraint.failed}")
            continue
        [(name, text)] = constraint.calls()
        if name != tool.name or CUSTOM_END in text or (
                tool.syntax and not accepts(tool, text)):
            failures.append(f"{tool.name}: {text!r}"[:200])
    assert not failures, failures


def test_parallel_calls_mix_functions_and_custom_tools(vocab: Vocabulary) -> None:  # noqa: F811
    both = plan(tools=[WEATHER, ADD, FREE], choice="required")
    assert both is not None
    reply = (TOOL_MARKER.join([
        '{"name": "add"}\nadd 1 2' + CUSTOM_END,
        '{"name": "get_weather", "arguments": {"city": "Bern"}}',
        '{"name": "note"}\nany text, even <tool_call> or {"x": 1}' + CUSTOM_END]))
    constraint = Constraint(vocab, both, budget=200)
    constraint.replay(vocab.tokenizer.tokenize_str(reply))
    assert not constraint.failed and constraint.matcher.is_accepting()
    assert constraint.calls() == [("add", "add 1 2"), ("get_weather", '{"city": "Bern"}'),
                                  ("note", 'any text, even <tool_call> or {"x": 1}')]
    # and an input outside its grammar is not taken
    wrong = Constraint(vocab, both, budget=200)
    wrong.replay(vocab.tokenizer.tokenize_str('{"name": "add"}\nadd one'))
    assert wrong.done and wrong.failed


def test_a_custom_input_streams_in_pieces_that_only_grow() -> None:
    text = f' {TOOL_MARKER}{{"name": "note"}}\nhello </tool world{CUSTOM_END}' \
           f'{TOOL_MARKER}{{"name": "f", "arguments": {{}}}}'
    seen: list[CallText] = []
    for n in range(len(text) + 1):
        calls = read_calls(text[:n])
        assert len(calls) >= len(seen)
        for before, now in zip(seen, calls, strict=False):
            assert now.name == before.name and now.arguments.startswith(before.arguments)
        seen = calls
    assert seen == [CallText("note", "hello </tool world", True, custom=True),
                    CallText("f", "{}", True)]
    assert read_calls('{"name": "note"}\nab</tool_in') == [
        CallText("note", "ab", False, custom=True)]
    assert split_calls(text) == [("note", "hello </tool world"), ("f", "{}")]


def test_split_takes_a_lark_input_that_holds_the_end_marker_whole() -> None:
    # A Lark grammar may allow CUSTOM_END inside its input: the call ends at the marker
    # followed by the end of the reply or the next call.
    text = f'{{"name": "x"}}\na{CUSTOM_END}b{CUSTOM_END}{TOOL_MARKER}{{"name": "y"}}\nc{CUSTOM_END}'
    assert split_calls(text) == [("x", f"a{CUSTOM_END}b"), ("y", "c")]


def test_job_plan_reads_custom_tool_specs() -> None:
    job = ChatJob(tools=[ToolSpec("add", kind="custom", syntax="lark",
                                  definition=ADD.definition),
                         ToolSpec("get_weather", WEATHER.parameters)], tool_choice="add")
    found = job_plan(job)
    assert found is not None and json.loads(found.grammar)["grammars"][1]["lark_grammar"] \
        == ADD.definition
    PlanRequest.of(job).compile()


def test_precheck_bounds_the_custom_grammars_size() -> None:
    half = "start: " + " | ".join(f'"{i}"' for i in range(MAX_TOTAL_DEFINITION_BYTES // 12))
    one = Tool("a", {}, kind="custom", syntax="lark", definition=half)
    precheck(PlanRequest(tools=[one]))
    with pytest.raises(TooComplex, match=re.escape("tools[2].format")):
        precheck(PlanRequest(tools=[one, WEATHER, Tool("b", {}, kind="custom",
                                                           syntax="lark", definition=half)]))


def test_the_tool_prompt_shows_how_to_call_a_custom_tool() -> None:
    spec = ToolSpec("add", kind="custom", syntax="lark", definition=ADD.definition,
                    description="Adds two numbers")
    [system, _user, example] = tool_prompt([spec, ToolSpec("f", {})], parallel=True)
    assert CUSTOM_END in system["content"]
    assert json.dumps(ADD.definition) in system["content"]  # the grammar, as JSON
    assert example["content"] == f'{TOOL_MARKER}{{"name": "add"}}\nexample{CUSTOM_END}'


def test_a_fed_back_custom_call_is_rendered_as_the_model_writes_one() -> None:
    from streaming.pipeline.prompting import rendered
    calls = [{"id": "c1", "type": "function", "function": {"name": "run", "arguments": "ls -l"}},
             {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    text = rendered(cast(Any, {"role": "assistant", "content": "", "tool_calls": calls}),
                    frozenset({"run"}))["content"]
    assert text == (f'{TOOL_MARKER}{{"name": "run"}}\nls -l{CUSTOM_END}'
                    f'{TOOL_MARKER}{{"name": "f", "arguments": {{}}}}')
    assert split_calls(text) == [("run", "ls -l"), ("f", "{}")]
