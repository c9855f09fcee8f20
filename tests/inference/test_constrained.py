"""Constrained decoding: a model with random weights still emits arguments that are
valid JSON matching the function's schema; unsupported schemas are refused clearly."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import jsonschema
import pytest

from inference.constrained import JsonConstraint, SchemaError, VocabIndex, validate
from inference.runtimes import load_runtime
from inference.runtimes.base import NewSequence, SamplingParams
from inference.runtimes.causal_lm import CausalLMRuntime
from inference.spec import DeploymentSpec, RuntimeName

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
        "detailed": {"type": "boolean"},
        "threshold": {"type": "number"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"},
                                                   "note": {"type": "null"}},
                  "required": ["lat"]},
    },
    "required": ["city", "unit", "days"],
}


@pytest.fixture(scope="module")
def tiny() -> CausalLMRuntime:
    runtime = load_runtime(DeploymentSpec("tiny", RuntimeName.TINY_CAUSAL_LM))
    assert isinstance(runtime, CausalLMRuntime)
    return runtime


@pytest.fixture(scope="module")
def vocab(tiny: CausalLMRuntime) -> VocabIndex:
    return VocabIndex(tiny.tokenizer, int(tiny.model.config.vocab_size))


def generate(rt: CausalLMRuntime, constraints: list[JsonConstraint],
             params: SamplingParams) -> list[str]:
    prompt = rt.encode_chat([{"role": "user", "content": "What's the weather in Paris?"}])
    seqs = [NewSequence(f"s{i}", prompt, replace(params, seed=(params.seed or 0) + i),
                        constraint=c) for i, c in enumerate(constraints)]
    tokens: dict[str, list[int]] = {rid: [tok] for rid, tok in rt.add(seqs).items()}
    for _ in range(400):
        if all(c.done for c in constraints):
            break
        running = {f"s{i}" for i, c in enumerate(constraints) if not c.done}
        for rid, tok in rt.step().items():
            if rid in running:  # its last token is the one that finished it
                tokens[rid].append(tok)
    rt.drop([s.rid for s in seqs])
    assert all(c.done for c in constraints), "the program must terminate"
    return [rt.decode(tokens[s.rid]) for s in seqs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_model_emits_schema_valid_arguments(tiny: CausalLMRuntime, vocab: VocabIndex,
                                                   temperature: float) -> None:
    params = SamplingParams(max_tokens=400, temperature=temperature, seed=7)
    constraints = [JsonConstraint.for_schema(WEATHER, vocab) for _ in range(8)]
    texts = generate(tiny, constraints, params)
    if temperature > 0:
        assert len(set(texts)) > 1, "different seeds explore different values"
    for text in texts:
        arguments = json.loads(text)
        jsonschema.validate(arguments, WEATHER)
        assert list(arguments) == list(WEATHER["properties"])


def test_constrained_and_free_sequences_share_a_batch(tiny: CausalLMRuntime,
                                                      vocab: VocabIndex) -> None:
    prompt = tiny.encode("hello")
    free = [tiny.add([NewSequence("free", prompt, SamplingParams(max_tokens=5))])["free"]]
    constraint = JsonConstraint.for_schema({"type": "object", "properties": {
        "ok": {"type": "boolean"}}}, vocab)
    out = [tiny.add([NewSequence("json", prompt, constraint=constraint)])["json"]]
    while not constraint.done:
        step = tiny.step()  # the step that finishes the constraint yields its last token
        out.append(step["json"])
        free.append(step["free"])
    tiny.drop(["free", "json"])
    assert json.loads(tiny.decode(out)) in ({"ok": True}, {"ok": False})
    assert len(free) > 1


@pytest.mark.parametrize(("schema", "fragment"), [
    ({"type": "object", "properties": {"x": {"type": "array"}}}, "'array' is not supported"),
    ({"type": "object", "properties": {"x": {"anyOf": []}}}, "anyOf"),
    ({"type": "object", "properties": {}, "required": ["y"]}, "required"),
    ({"type": "object", "properties": {"x": {"enum": []}}}, "enum"),
    ("not a schema", "must be a JSON schema object"),
    # A maxLength the decoder could not count with (it stopped the worker mid-step).
    ({"type": "string", "maxLength": "20"}, "maxLength"),
    ({"type": "string", "maxLength": 0}, "maxLength"),
    ({"type": "string", "maxLength": 2.5}, "maxLength"),
    ({"type": "string", "maxLength": True}, "maxLength"),
    ({"type": "string", "maxLength": 10**9}, "maxLength"),
    ({"type": "object", "properties": {"x": {"type": "string"}}, "required": [["x"]]},
     "required"),
])
def test_unsupported_schemas_are_refused(schema: Any, fragment: str) -> None:
    with pytest.raises(SchemaError, match=fragment):
        validate(schema)


def test_a_maxlength_from_a_protobuf_struct_is_a_whole_number(
        tiny: CausalLMRuntime, vocab: VocabIndex) -> None:
    schema = {"type": "string", "maxLength": 3.0}  # gRPC's Struct: every number a float
    params = SamplingParams(max_tokens=50, temperature=1.5, seed=5)
    texts = generate(tiny, [JsonConstraint.for_schema(schema, vocab) for _ in range(4)], params)
    assert all(len(json.loads(text)) <= 3 for text in texts), texts


def test_numbers_stop_within_their_token_budget(tiny: CausalLMRuntime, vocab: VocabIndex) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "x": {"type": "number"}}}
    params = SamplingParams(max_tokens=400, temperature=1.5, seed=3)
    constraints = [JsonConstraint.for_schema(schema, vocab) for _ in range(8)]
    for text in generate(tiny, constraints, params):
        value = json.loads(text)
        jsonschema.validate(value, schema)
        assert len(str(value["n"])) <= 13, "at most MAX_DIGIT_TOKENS digit tokens (+ sign)"


def test_auto_mode_switches_to_a_constrained_call_after_the_marker(vocab: VocabIndex) -> None:
    import torch

    from inference.tools import ToolCallConstraint, parse_tools
    from inference.toolschema import TOOL_MARKER

    tools = parse_tools([{"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"]}}])
    constraint = ToolCallConstraint.build(vocab, tools, "auto")
    free = torch.randn(vocab.size)
    for token in vocab.encode(TOOL_MARKER):
        assert constraint.choose(free) is free, "undecided: the model writes freely"
        constraint.advance(token)
    assert constraint.mode == "call"
    generator = torch.Generator().manual_seed(0)
    while not constraint.call_complete:
        choice = constraint.choose(torch.randn(vocab.size, generator=generator))
        constraint.advance(choice if isinstance(choice, int) else int(choice.argmax()))
    name, arguments = constraint.call()
    assert name == "get_time" and json.loads(arguments)["zone"] in ("UTC", "CET")
    text_reply = ToolCallConstraint.build(vocab, tools, "auto")
    for token in vocab.encode("Hello there"):
        text_reply.advance(token)
    assert text_reply.done and not text_reply.call_complete, "plain text stays plain text"
