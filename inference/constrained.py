"""Constrained decoding: generation that can only produce JSON matching a schema.

The groundwork for tool calling (issue #4): a function's `parameters` schema compiles to
a program of forced literals (braces, keys, separators: their tokens are forced) and
constrained values (strings: tokens without quotes, backslashes or control characters,
closed by the quote token; integers and numbers: digit tokens; enums, booleans and null:
a trie over the tokenised alternatives). Even a model with random weights emits valid
arguments; a real model chooses the values.

Supported schema subset (anything else is a SchemaError, so a caller gets a clear 400):
type object (properties, required: every property is emitted, required or not), string
(enum, maxLength), integer, number, boolean, null, enum of JSON scalars,
nested objects. Not supported: arrays, anyOf/oneOf/allOf, $ref, patterns, formats.
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from inference.toolschema import SchemaError, validate  # noqa: F401 - re-exported

MAX_STRING_CHARS = 200  # a string without maxLength is closed after this many characters
MAX_DIGIT_TOKENS = 12
_NUMBER_PREFIX = re.compile(r"^-?$|^-?(0|[1-9]\d*)(\.\d*)?$")
_INTEGER_PREFIX = re.compile(r"^-?$|^-?(0|[1-9]\d*)$")
_NUMBER = re.compile(r"^-?(0|[1-9]\d*)(\.\d+)?$")
_NEVER = re.compile(r"(?!)")


class VocabIndex:
    """Boolean masks over a tokenizer's vocabulary, built once per runtime."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        texts += [""] * (vocab_size - len(texts))
        self.size = vocab_size
        self.string_safe = torch.tensor([
            bool(t) and '"' not in t and "\\" not in t and all(ord(c) >= 32 for c in t)
            and "\ufffd" not in t for t in texts])
        self.digits = torch.tensor([bool(t) and t.isdigit() and t.isascii() for t in texts])
        self.texts = texts
        self.number_tokens = [i for i, t in enumerate(texts)
                              if t and (t in ("-", ".") or (t.isdigit() and t.isascii()))]
        self.lengths = torch.tensor([len(t) for t in texts])
        self.quote = texts.index('"')
        self.minus = texts.index("-") if "-" in texts else None
        self.dot = texts.index(".") if "." in texts else None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


# -- the program: what comes next ----------------------------------------------------
@dataclass
class Literal:
    ids: list[int]


@dataclass
class Choice:
    """One of several token sequences (a trie walk); sends back the index chosen."""

    options: list[list[int]]


@dataclass
class FreeString:
    max_chars: int


@dataclass
class Digits:
    """Digit tokens; ends when the model picks `end` (the next literal's first token)."""

    end: int
    allow_dot: bool
    max_tokens: int = MAX_DIGIT_TOKENS


Instr = Literal | Choice | FreeString | Digits


def compile_program(schema: dict[str, Any],
                    vocab: VocabIndex) -> Generator[Instr, int | None, None]:
    """Yield instructions; a Choice is answered (via send) with the option chosen."""
    yield from _value(schema, vocab, follow="")


def _value(schema: dict[str, Any], vocab: VocabIndex,
           follow: str) -> Generator[Instr, int | None, None]:
    if "enum" in schema:
        yield Choice([vocab.encode(json.dumps(v)) for v in schema["enum"]])
        return
    kind = schema.get("type")
    if kind == "object":
        props = list(schema.get("properties", {}).items())
        opening = "{"
        keys = [f"{opening if i == 0 else ', '}{json.dumps(name)}: "
                for i, (name, _sub) in enumerate(props)]
        for i, (_name, sub) in enumerate(props):
            yield Literal(vocab.encode(keys[i]))
            # What follows the value: a Digits value ends when the model picks its first
            # token, so it must be the very literal that comes next.
            yield from _value(sub, vocab, follow=keys[i + 1] if i + 1 < len(props) else "}")
        yield Literal(vocab.encode("{}" if not props else "}"))
    elif kind == "string":
        yield Literal([vocab.quote])
        yield FreeString(int(schema.get("maxLength", MAX_STRING_CHARS)))
    elif kind in ("integer", "number"):
        end = vocab.encode(follow)[0] if follow else vocab.quote
        yield Digits(end=end, allow_dot=kind == "number")
    elif kind == "boolean":
        yield Choice([vocab.encode("true"), vocab.encode("false")])
    else:  # null
        yield Literal(vocab.encode("null"))


@dataclass
class JsonConstraint:
    """Drives one sequence through a compiled program, token by token."""

    vocab: VocabIndex
    program: Generator[Instr, int | None, None]
    emitted: list[int] = field(default_factory=list)
    done: bool = False
    _current: Instr | None = None
    _forced: list[int] = field(default_factory=list)
    _trie_prefix: list[int] = field(default_factory=list)
    _count: int = 0
    _chars: int = 0
    _number: str = ""
    _skip_next_literal_head: bool = False

    @classmethod
    def for_schema(cls, schema: dict[str, Any], vocab: VocabIndex) -> JsonConstraint:
        validate(schema)
        constraint = cls(vocab, compile_program(schema, vocab))
        constraint._next(None)
        return constraint

    def _next(self, answer: int | None) -> None:
        try:
            instr = self.program.send(answer) if self._current is not None else next(
                self.program)
        except StopIteration:
            self._current, self.done = None, True
            return
        self._current, self._count, self._chars, self._trie_prefix = instr, 0, 0, []
        self._number = ""
        if isinstance(instr, Literal):
            self._forced = list(instr.ids)
            if self._skip_next_literal_head:
                self._forced = self._forced[1:]  # the model already chose it
                self._skip_next_literal_head = False
            if not self._forced:
                self._next(None)

    def choose(self, logits: torch.Tensor) -> torch.Tensor | int:
        """A forced token id, or the logits with disallowed tokens at -inf."""
        instr = self._current
        if self._forced:
            return self._forced[0]
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
        if isinstance(instr, Choice):
            depth = len(self._trie_prefix)
            for option in instr.options:
                if option[:depth] == self._trie_prefix and len(option) > depth:
                    mask[option[depth]] = True
        elif isinstance(instr, FreeString):
            room = instr.max_chars - self._chars
            fits = self.vocab.string_safe & (self.vocab.lengths <= room)
            mask[: self.vocab.size] |= fits[: logits.shape[-1]]
            mask[self.vocab.quote] = True
        elif isinstance(instr, Digits):
            # Any token that keeps the text a prefix of a JSON number (no leading zeros,
            # at most one dot for numbers, none for integers), and the end token once
            # the text is a whole number.
            complete = bool(_NUMBER.match(self._number))
            prefix = _NUMBER_PREFIX if instr.allow_dot else _INTEGER_PREFIX
            if self._count >= instr.max_tokens:
                # Out of room: end now, or take only a token that completes the number.
                prefix = _NEVER if complete else _NUMBER
            for token in self.vocab.number_tokens:
                if prefix.match(self._number + self.vocab.texts[token]):
                    mask[token] = True
            if complete:
                mask[instr.end] = True
        return logits.masked_fill(~mask.to(logits.device), float("-inf"))

    def advance(self, token: int) -> None:
        self.emitted.append(token)
        instr = self._current
        if self._forced:
            self._forced.pop(0)
            if not self._forced:
                self._next(None)
            return
        self._count += 1
        if isinstance(instr, Choice):
            self._trie_prefix.append(token)
            done = [i for i, o in enumerate(instr.options) if o == self._trie_prefix]
            if done:
                self._next(done[0])
        elif isinstance(instr, FreeString):
            if token == self.vocab.quote:
                self._next(None)
            else:
                self._chars += int(self.vocab.lengths[token])
        elif isinstance(instr, Digits):
            if token == instr.end:
                self._skip_next_literal_head = True
                self._next(None)
            else:
                self._number += self.vocab.texts[token]


def apply(logits: torch.Tensor, constraints: Sequence[Any]) -> list[int | None]:
    """Mask each constrained row in place; return forced tokens (None: sample the row)."""
    forced: list[int | None] = []
    for row, constraint in enumerate(constraints):
        if constraint is None or constraint.done:
            forced.append(None)
            continue
        choice = constraint.choose(logits[row])
        if isinstance(choice, int):
            forced.append(choice)
        else:
            logits[row] = choice
            forced.append(None)
    return forced
