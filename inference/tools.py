"""Tool calling on the worker side: which function a sequence may call, and the
constraint that makes its call valid.

The call is written as an envelope, `{"name": <one of the tools>, "arguments": {...}}`,
generated under a JsonConstraint-style program: the name is a choice among the declared
tools, the arguments follow that function's parameter schema. With tool_choice "auto"
the model writes free text unless it starts its reply with TOOL_MARKER, at which point
the envelope takes over. Only one call per reply is made (parallel_tool_calls allows
several; producing one is within it).
"""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from inference.constrained import (
    Choice,
    Instr,
    JsonConstraint,
    Literal,
    VocabIndex,
    compile_program,
)
from inference.toolschema import TOOL_MARKER, validate


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict[str, Any]


def parse_tools(raw: list[dict[str, Any]]) -> list[ToolSpec]:
    tools = []
    for item in raw:
        parameters = item.get("parameters") or {"type": "object", "properties": {}}
        validate(parameters)
        tools.append(ToolSpec(item["name"], parameters))
    return tools


def _envelope(tools: list[ToolSpec], vocab: VocabIndex) -> Generator[Instr, int | None, None]:
    yield Literal(vocab.encode('{"name": '))
    chosen = yield Choice([vocab.encode(json.dumps(t.name)) for t in tools])
    assert chosen is not None  # noqa: S101 - a Choice is always answered
    yield Literal(vocab.encode(', "arguments": '))
    yield from compile_program(tools[chosen].parameters, vocab)
    yield Literal(vocab.encode("}"))


@dataclass
class ToolCallConstraint:
    """Drives a sequence that may (auto) or must (required, named) call a tool.

    `done` means "stop constraining" (a finished call, or free text in auto mode);
    `call_complete` means a whole call was written and the sequence should end."""

    vocab: VocabIndex
    tools: list[ToolSpec]
    mode: str  # "auto" | "call"
    inner: JsonConstraint | None = None
    text: str = ""
    done: bool = False
    call_complete: bool = False
    emitted: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, vocab: VocabIndex, tools: list[ToolSpec], choice: str) -> ToolCallConstraint:
        if choice == "auto":
            return cls(vocab, tools, "auto")
        chosen = tools if choice == "required" else [t for t in tools if t.name == choice]
        constraint = cls(vocab, chosen, "call")
        constraint._start_call()
        return constraint

    def _start_call(self) -> None:
        inner = JsonConstraint(self.vocab, _envelope(self.tools, self.vocab))
        inner._next(None)
        self.inner, self.mode = inner, "call"

    def choose(self, logits: torch.Tensor) -> torch.Tensor | int:
        if self.inner is None:
            return logits  # auto mode, still deciding: unconstrained
        return self.inner.choose(logits)

    def advance(self, token: int) -> None:
        self.emitted.append(token)
        if self.inner is not None:
            self.inner.advance(token)
            if self.inner.done:
                self.done = self.call_complete = True
            return
        self.text += self.vocab.texts[token]
        if self.text.lstrip().startswith(TOOL_MARKER):
            self._start_call()
        elif not TOOL_MARKER.startswith(self.text.lstrip()):
            self.done = True  # a plain text reply

    def call(self) -> tuple[str, str]:
        """(name, arguments JSON) of the finished call."""
        assert self.inner is not None  # noqa: S101
        envelope = json.loads(self.vocab.tokenizer.decode(self.inner.emitted))
        return envelope["name"], json.dumps(envelope["arguments"])
