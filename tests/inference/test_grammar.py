"""Structured generation on llguidance: a model with random weights writes replies that
validate against every schema of the corpus (tests/inference/grammar_corpus.py), as a
response format and as a forced tool call, greedy and sampled; keywords the engine
cannot enforce are refused by name; auto, parallel calls and resumption."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from inference.runtimes import load_runtime
from inference.runtimes.base import NewSequence, SamplingParams
from inference.runtimes.causal_lm import CausalLMRuntime
from inference.spec import DeploymentSpec, RuntimeName
from inference.structured import masks
from inference.structured.constraint import Constraint, Vocabulary
from inference.structured.grammar import TOOL_MARKER, GrammarError, Tool, plan
from tests.inference.grammar_corpus import REFUSED, SCHEMAS

BUDGET = 96


@pytest.fixture(scope="module")
def tiny() -> CausalLMRuntime:
    runtime = load_runtime(DeploymentSpec("tiny", RuntimeName.TINY_CAUSAL_LM))
    assert isinstance(runtime, CausalLMRuntime)
    return runtime


@pytest.fixture(scope="module")
def vocab(tiny: CausalLMRuntime) -> Vocabulary:
    return Vocabulary(tiny.tokenizer, int(tiny.model.config.vocab_size),
                      sorted(tiny.eos_token_ids))


def generate(rt: CausalLMRuntime, constraints: list[Constraint], *, temperature: float,
             seed: int, budget: int = BUDGET) -> list[str]:
    """Run the constrained rows together in one batch until each grammar is complete
    (or the budget is spent); the text each constraint took."""
    prompt = rt.encode_chat([{"role": "user", "content": "Fill in the form."}])
    seqs = [NewSequence(f"s{i}", prompt, SamplingParams(max_tokens=budget,
                                                       temperature=temperature,
                                                       seed=seed + i), constraint=c)
            for i, c in enumerate(constraints)]
    rt.add(seqs)
    for _ in range(budget):
        if all(c.done for c in constraints):
            break
        rt.step()
    rt.drop([s.rid for s in seqs])
    return [rt.decode([t for t in c.emitted if t not in rt.eos_token_ids])
            for c in constraints]


def _rows(vocab: Vocabulary) -> Iterator[tuple[str, str, Constraint]]:
    for name, schema in SCHEMAS.items():
        yield name, "format", Constraint(vocab, plan(response_format={"schema": schema}),
                                         budget=BUDGET)
        # A tool's parameters are an object: any other schema is wrapped (its $defs
        # stay at the root, where its references point).
        inner = {k: v for k, v in schema.items() if k != "$defs"}
        tool = Tool(f"fill_{len(name)}", schema if schema.get("type") == "object"
                    else {"type": "object", "properties": {"value": inner},
                          "required": ["value"], "$defs": schema.get("$defs", {})})
        yield name, "call", Constraint(vocab, plan(tools=[tool, Tool("other", {})],
                                                   choice=tool.name, parallel=False),
                                       budget=BUDGET)


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 0), (1.0, 0), (1.0, 1000)])
def test_every_schema_of_the_corpus_validates_as_format_and_as_call(
        tiny: CausalLMRuntime, vocab: Vocabulary, temperature: float, seed: int) -> None:
    """Given the corpus's schemas (nested pydantic models, arrays of objects, recursive
    $ref, anyOf/null, patterns, formats, ranges, enums, additionalProperties), when the
    random-weights model writes each as a structured answer and as a forced call, then
    every reply is complete and valid."""
    assert len(SCHEMAS) >= 30
    rows = list(_rows(vocab))
    texts = generate(tiny, [c for _n, _k, c in rows], temperature=temperature, seed=seed)
    failures = []
    for (name, kind, constraint), text in zip(rows, texts, strict=True):
        schema = SCHEMAS[name]
        try:
            assert constraint.complete, f"not complete: {constraint.failed or text[:80]}"
            if kind == "call":
                [(_fn, arguments)] = constraint.calls()
                value = json.loads(arguments)
                value = value if schema.get("type") == "object" else value["value"]
            else:
                value = json.loads(text)
            jsonschema.validate(value, schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{name}/{kind}: {exc}"[:200])
    assert not failures, failures


@pytest.mark.parametrize("keyword", sorted(REFUSED))
def test_a_keyword_the_engine_cannot_enforce_is_refused_by_name(keyword: str) -> None:
    with pytest.raises(GrammarError, match=keyword):
        plan(response_format={"schema": REFUSED[keyword]})
    with pytest.raises(GrammarError, match=keyword) as caught:
        plan(tools=[Tool("f", REFUSED[keyword])], choice="required")
    assert str(caught.value).startswith("tools[0].function.parameters")


def test_strict_schemas_follow_openais_rules() -> None:
    loose = {"type": "object", "properties": {"a": {"type": "string"}}}
    with pytest.raises(GrammarError, match="additionalProperties"):
        plan(response_format={"schema": loose, "strict": True})
    with pytest.raises(GrammarError, match="required"):
        plan(response_format={"schema": {**loose, "additionalProperties": False},
                              "strict": True})
    assert plan(response_format={"schema": {**loose, "additionalProperties": False,
                                            "required": ["a"]}, "strict": True})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_object_is_always_an_object(tiny: CausalLMRuntime, vocab: Vocabulary,
                                         temperature: float) -> None:
    constraints = [Constraint(vocab, plan(response_format={"type": "json_object"}),
                              budget=BUDGET) for _ in range(6)]
    for text in generate(tiny, constraints, temperature=temperature, seed=5):
        assert isinstance(json.loads(text), dict), text


WEATHER = Tool("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 7},
             "maxItems": 3}}, "required": ["city", "days"], "additionalProperties": False})
TIME = Tool("get_time", {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                         "required": ["zone"]})


def _feed(constraint: Constraint, vocab: Vocabulary, text: str) -> None:
    constraint.replay(vocab.tokenizer.tokenize_str(text))


def test_auto_is_free_text_until_the_marker_then_a_valid_call(
        tiny: CausalLMRuntime, vocab: Vocabulary) -> None:
    text = Constraint(vocab, plan(tools=[WEATHER, TIME]), budget=BUDGET)
    _feed(text, vocab, "Hello there")
    assert text.done and text.kind() == "text" and not text.complete

    call = Constraint(vocab, plan(tools=[WEATHER, TIME]), budget=BUDGET)
    for token in vocab.tokenizer.tokenize_str(TOOL_MARKER)[:-1]:
        call.advance(token)
        assert not call.masking and call.kind() == "", "undecided: the model writes freely"
    call.advance(vocab.tokenizer.tokenize_str(TOOL_MARKER)[-1])
    assert call.masking and call.kind() == "calls"
    generate(tiny, [call], temperature=1.0, seed=3)
    assert call.complete
    for name, arguments in call.calls():
        tool = {"get_weather": WEATHER, "get_time": TIME}[name]
        jsonschema.validate(json.loads(arguments), tool.parameters)


def test_parallel_grammar_takes_several_calls_and_single_only_one(vocab: Vocabulary) -> None:
    one = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    two = one + TOOL_MARKER + \
        '{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2]}}'
    parallel = Constraint(vocab, plan(tools=[WEATHER, TIME], choice="required"),
                          budget=BUDGET)
    _feed(parallel, vocab, two)
    assert not parallel.failed and parallel.accepting()
    assert [name for name, _ in parallel.calls()] == ["get_time", "get_weather"]
    single = Constraint(vocab, plan(tools=[WEATHER, TIME], choice="required",
                                    parallel=False), budget=BUDGET)
    _feed(single, vocab, one)
    assert single.complete, "one call and the grammar is finished"
    extra = Constraint(vocab, plan(tools=[WEATHER, TIME], choice="required",
                                   parallel=False), budget=BUDGET)
    _feed(extra, vocab, two)
    assert extra.done and extra.emitted, "a second call cannot follow"


def test_tools_with_a_format_give_either_the_answer_or_a_call(vocab: Vocabulary) -> None:
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    both = plan(tools=[TIME], response_format={"schema": answer})
    assert both is not None
    as_answer = Constraint(vocab, both, budget=BUDGET)
    _feed(as_answer, vocab, '{"ok": true}')
    assert as_answer.complete and as_answer.kind() == "text"
    as_call = Constraint(vocab, both, budget=BUDGET)
    _feed(as_call, vocab, TOOL_MARKER + '{"name": "get_time", "arguments": {"zone": "CET"}}')
    assert as_call.kind() == "calls" and as_call.accepting() and not as_call.failed
    assert as_call.calls() == [("get_time", '{"zone": "CET"}')]


def test_a_resumed_value_continues_valid_from_what_was_streamed(
        tiny: CausalLMRuntime, vocab: Vocabulary) -> None:
    """Given a reply cut mid-value (a worker died), a new constraint fed what was
    streamed finishes the same value validly."""
    schema = SCHEMAS["object_array"]
    head = '{"items": [{"sku": "ABC-1'
    resumed = Constraint(vocab, plan(response_format={"schema": schema}), budget=BUDGET)
    _feed(resumed, vocab, head)
    assert resumed.masking and not resumed.failed
    [tail] = generate(tiny, [resumed], temperature=1.0, seed=11)
    jsonschema.validate(json.loads(tail), schema)
    assert tail.startswith(head)


def test_masks_are_computed_beside_the_forward_pass(vocab: Vocabulary) -> None:
    """`start` returns a future (llguidance's threads fill the bitmask) for the masking
    rows only; a row that is not masking keeps its logits."""
    import torch

    free = Constraint(vocab, plan(tools=[TIME]), budget=BUDGET)  # auto: undecided
    bound = Constraint(vocab, plan(tools=[TIME], choice="get_time"), budget=BUDGET)
    pending = masks.start([free, None, bound])
    assert pending is not None
    computed = pending.result()
    assert computed.rows == [2]
    logits = torch.zeros(3, vocab.size)
    computed.apply(logits)
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[1]).all()
    allowed = torch.isfinite(logits[2]).nonzero().flatten().tolist()
    assert vocab.decode(allowed[:1]).startswith("{")



def test_smollm2_answers_a_weather_question_with_a_call_and_others_in_text() -> None:
    """`auto` with a real model: the tool prompt (streaming/pipeline/structured.py) and the
    grammar taking over at the marker turn a weather question into a valid call, while
    a question no function answers stays text."""
    from inference.jobs import ToolSpec
    from inference.weights import SMOLLM2
    from streaming.pipeline.structured import tool_prompt

    rt = load_runtime(DeploymentSpec("smol", RuntimeName.CAUSAL_LM, weights=SMOLLM2))
    assert isinstance(rt, CausalLMRuntime)
    smol = Vocabulary(rt.tokenizer, int(rt.model.config.vocab_size), sorted(rt.eos_token_ids))
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city"], "additionalProperties": False}
    tool = ToolSpec("get_weather", weather, description="Current weather for a city")
    kinds = {}
    for question in ("What's the weather like in Paris right now?",
                     "What is the capital of France?"):
        prompt = rt.encode_chat([*tool_prompt([tool], parallel=False),
                                 {"role": "user", "content": question}])
        constraint = Constraint(smol, plan(tools=[Tool("get_weather", weather)],
                                           parallel=False), budget=60)
        rt.add([NewSequence("q", prompt, SamplingParams(max_tokens=60), constraint=constraint)])
        for _ in range(60):
            if constraint.done or constraint.kind() == "text":
                break
            rt.step()
        rt.drop(["q"])
        kinds[question] = constraint.kind()
        if constraint.kind() == "calls":
            assert constraint.complete
            [(name, arguments)] = constraint.calls()
            assert name == "get_weather"
            assert "paris" in json.loads(arguments)["city"].lower()
            jsonschema.validate(json.loads(arguments), weather)
    assert list(kinds.values()) == ["calls", "text"], kinds


def test_properties_are_written_in_the_schemas_own_order(vocab: Vocabulary) -> None:
    """The worker's plan keeps each schema's key order (llguidance writes properties in
    it): a schema listing zeta before alpha gets zeta first."""
    from inference.jobs import ChatJob, ToolSpec
    from inference.structured.constraint import plan_for

    ordered = {"type": "object", "properties": {"zeta": {"const": 1}, "alpha": {"const": 2}},
               "required": ["zeta", "alpha"], "additionalProperties": False}
    found = plan_for(ChatJob(tools=[ToolSpec("w", ordered)], tool_choice="w"))
    assert found is not None
    constraint = Constraint(vocab, found, budget=BUDGET)
    forced = constraint.matcher.compute_ff_bytes().decode()
    assert forced.startswith('{"name": "w", "arguments": {"zeta": 1, "alpha": 2}'), forced


EDIT_FILE = Tool("edit_file", {"type": "object", "properties": {
    "path": {"type": "string"},
    "edits": {"type": "array", "minItems": 1, "items": {
        "type": "object", "properties": {"old": {"type": "string"}, "new": {"type": "string"}},
        "required": ["old", "new"]}}}, "required": ["path", "edits"]})


def _closing_choice(vocab: Vocabulary, head: str) -> str:
    """The text of the token the closing rule picks after `head` (a forced edit_file
    call's text so far), its budget spent."""
    import torch

    constraint = Constraint(vocab, plan(tools=[EDIT_FILE], choice="edit_file"), budget=1)
    _feed(constraint, vocab, head)
    assert constraint.closing and constraint.masking and not constraint.failed
    computed = masks.now([constraint])
    assert computed is not None
    logits = torch.zeros(1, vocab.size)
    computed.apply(logits)
    [chosen] = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    return vocab.decode([chosen])


def test_closing_ends_arrays_and_objects_as_soon_as_their_schema_allows(
        vocab: Vocabulary) -> None:
    """Given an array of objects whose minItems is met, the closing rule ends the array
    (not a comma that opens another item), and in an item's last required string it
    ends the string and the item (not the string alone, or a new item)."""
    head = '{"name": "edit_file", "arguments": {"path": "a.py", "edits": [{"old": "x"'
    assert _closing_choice(vocab, head + ', "new": "y"}').startswith("]")
    inside = _closing_choice(vocab, head + ', "new": "y')
    assert inside.startswith('"}') and "," not in inside


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 0), (1.0, 7)])
def test_a_forced_call_with_an_array_of_objects_completes_within_its_budget(
        tiny: CausalLMRuntime, vocab: Vocabulary, temperature: float, seed: int) -> None:
    """Given a forced edit_file call (edits: an array of {old, new}, minItems 1) and 400
    tokens, the random-weights model's call is complete and valid before the budget
    ends: the closing rule does not keep adding items until it runs out."""
    constraint = Constraint(vocab, plan(tools=[EDIT_FILE], choice="edit_file"), budget=400)
    generate(tiny, [constraint], temperature=temperature, seed=seed, budget=400)
    assert constraint.complete, constraint.failed or "cut at the budget"
    [(name, arguments)] = constraint.calls()
    assert name == "edit_file" and len(constraint.emitted) <= 400
    jsonschema.validate(json.loads(arguments), EDIT_FILE.parameters)
