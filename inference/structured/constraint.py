"""One sequence's grammar state during generation, and the vocabulary it is checked
against: llguidance matchers over the runtime's own tokenizer (inference/structured/grammar.py
makes the grammars).

A Constraint is advanced with every token its sequence generates (`advance`, by the
sampler on the model thread) and read by the worker (`kind`, `complete`, `calls`). Its
masks are computed for a whole batch at once, on llguidance's threads, while the model
runs its forward pass (inference/structured/masks.py). Contract:
- `masking`: the next token must be one the matcher allows (mask it); False while an
  "auto" reply has not begun a call yet, and once the constraint is `done`;
- `done`: nothing more to constrain: the grammar is complete (`complete`), the reply
  turned out to be free text, or the matcher failed (it never should: every token it
  sees was allowed by its own mask; a failure ends the constraint, not the worker);
- `closing`: the sequence's token budget is nearly spent: the sampler then prefers
  tokens that close the value (quotes, brackets), so a started value ends valid
  within max_tokens instead of being cut off: an array ends as soon as its minItems
  allow, an object as soon as its required properties are in (`closing_choice`);
- `replay(ids)`: a resumed delivery's already streamed tokens, fed through.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from inference.jobs import ChatJob, decode_job, encode_job
from inference.structured.grammar import TOOL_MARKER, Plan, job_plan, split_calls
from inference.structured.toolstream import read_calls

_CLOSERS = frozenset('"}],')


def plan_for(job: ChatJob) -> Plan | None:
    """The plan of a chat job's `tools`, `tool_choice`, `parallel_tool_calls` and
    `response_format` (ValueError when they cannot be enforced). Plans are cached: an
    agent sends the same tools with every turn (the key keeps the schemas' own key
    order: llguidance writes properties in that order)."""
    return _cached_plan(encode_job(ChatJob(
        tools=job.tools, tool_choice=job.tool_choice,
        parallel_tool_calls=job.parallel_tool_calls, response_format=job.response_format)))


@functools.lru_cache(maxsize=256)
def _cached_plan(key: bytes) -> Plan | None:
    job = decode_job(key)
    assert isinstance(job, ChatJob)  # noqa: S101 (plan_for made the key)
    return job_plan(job)  # GrammarError is a ValueError


class Vocabulary:
    """A runtime's tokenizer as llguidance sees it (built once per worker: ~1 s)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos: list[int]) -> None:
        import llguidance.hf  # transformers: only on a worker that constrains

        self.tokenizer: LLTokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        texts = hf_tokenizer.batch_decode([[i] for i in range(len(hf_tokenizer))])
        self.texts = texts + [""] * (vocab_size - len(texts))
        closers = np.array([bool(t) and set(t) <= _CLOSERS for t in self.texts])
        self.closer_ids = [int(i) for i in np.flatnonzero(closers)]
        self.eos = eos
        self.executor = LLExecutor()
        self._templates: dict[str, LLMatcher] = {}

    def matcher(self, grammar: str) -> LLMatcher:
        """A fresh matcher of `grammar`: a copy of one compiled once per grammar (a copy
        costs microseconds, a compile about a millisecond)."""
        template = self._templates.get(grammar)
        if template is None:
            if len(self._templates) >= 256:
                self._templates.clear()
            template = self._templates[grammar] = LLMatcher(self.tokenizer, grammar,
                                                             log_level=0)
        return template.deep_copy()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode_str(ids)


class Constraint:
    def __init__(self, vocab: Vocabulary, plan: Plan, *, budget: int) -> None:
        self.vocab, self.plan = vocab, plan
        self.matcher = vocab.matcher(plan.grammar)
        self.watching = plan.watch_marker
        self.emitted: list[int] = []
        self.done = self.complete = self.free = False
        self.failed = ""  # the matcher's error, if it ever fails
        self._head = ""  # the reply's first characters, until its kind is known
        self._kind = "text" if not plan.tools else ("calls" if plan.calls_only else "")
        # The last quarter of the budget (at least 16 tokens) is for closing the value:
        # what a schema still requires after a string closes (keys, separators) costs
        # a step per token.
        self._closing_at = max(1, budget - max(16, budget // 4))
        if self.matcher.is_error():
            self._fail()

    @property
    def masking(self) -> bool:
        return not self.done and not self.watching

    @property
    def closing(self) -> bool:
        return len(self.emitted) >= self._closing_at

    def kind(self) -> str:
        """"text" (the reply is content: free text or the structured answer), "calls",
        or "" while that is not known yet."""
        return "text" if self.free else self._kind

    def advance(self, token: int) -> None:
        self.emitted.append(token)
        if self.done:
            return
        if not self._kind:
            self._decide(self.vocab.texts[token])
        if self.watching:
            self._watch()
            return
        if not self.matcher.consume_token(token):
            self._fail()
        elif self.matcher.is_stopped():
            self.done = self.complete = True

    def replay(self, ids: list[int]) -> None:
        for token in ids:
            self.advance(token)

    def accepting(self) -> bool:
        """The grammar may end here (an end-of-sequence token is allowed)."""
        return self.complete or (self.masking and self.matcher.is_accepting())

    def closing_choice(self, allowed: list[int]) -> list[int]:
        """Among `allowed` (the end-of-sequence and closing tokens the mask allows: quotes,
        brackets, commas), the one that finishes the grammar soonest: an end-of-sequence
        token when it may end now; else the token after which it may end soonest
        (through the forced tokens that follow it and one more closer); else the one
        that leaves the fewest strings, arrays and objects open (with what it forces:
        `]` over a `,` that would open another item, a `}` over one that would begin
        another key); else the one whose forced continuation is longest (a comma that
        ends a number and brings the next required key). [] when none makes progress
        (closes nothing, forces nothing): the row then samples as usual. Leaves the
        matcher as it was (every trial is rolled back)."""
        ends = [t for t in allowed if t in self.vocab.eos]
        if ends:
            return ends
        value = self._value()
        start = None if value is None else _scan(value, (0, False, False))
        m, best, best_score = self.matcher, [], (4, 0, 0)
        for token in allowed:
            if m.try_consume_tokens([token]) != 1:
                continue
            score = self._progress(allowed, token, start)
            m.rollback(1)
            if score < best_score:
                best, best_score = [token], score
        return best

    def _progress(self, closers: list[int], token: int, start: _Scan | None
                  ) -> tuple[int, int, int]:
        """From the matcher's state after `token`: (tokens until the grammar may end, 3
        when not within two; how many values stay open once the forced continuation is
        written, 0 when `start`, the state before `token`, is unknown; minus the length
        of that continuation); (4, 0, 0) when `token` makes no progress."""
        m = self.matcher
        if m.is_stopped() or m.is_accepting():
            return (0, 0, 0)
        forced = m.compute_ff_tokens()
        taken = m.try_consume_tokens(forced) if forced else 0
        try:
            open_after = 0 if start is None else _open(
                _scan(self.vocab.decode([token, *forced[:taken]]), start))
            if m.is_stopped() or m.is_accepting():
                return (1, open_after, -taken)
            for closer in closers:
                if m.try_consume_tokens([closer]) == 1:
                    done = m.is_stopped() or m.is_accepting()
                    m.rollback(1)
                    if done:
                        return (2, open_after, -taken)
            if taken or (start is not None and open_after < _open(start)):
                return (3, open_after, -taken)
            return (4, 0, 0)
        finally:
            if taken:
                m.rollback(taken)

    def _value(self) -> str | None:
        """The text of the JSON value being written, from its start: the answer, or the
        open function call's arguments; None when what is being written is not a JSON
        value read from its start (a call's name or envelope, a custom tool's input)."""
        eos = self.vocab.eos
        text = self.vocab.decode([t for t in self.emitted if t not in eos])
        if self.kind() == "text":
            return text
        if self.kind() != "calls":
            return None
        calls = read_calls(text)
        if not calls or calls[-1].complete or calls[-1].custom:
            return None
        return calls[-1].arguments

    def calls(self) -> list[tuple[str, str]]:
        """(name, arguments JSON) of each call of a finished reply."""
        eos = self.vocab.eos
        return split_calls(self.vocab.decode([t for t in self.emitted if t not in eos]))

    def _decide(self, text: str) -> None:
        self._head += text
        head = self._head.lstrip()
        if head.startswith(TOOL_MARKER):
            self._kind = "calls"
        elif head and not TOOL_MARKER.startswith(head):
            self._kind = "text"

    def _watch(self) -> None:
        """An "auto" reply: free until it begins with TOOL_MARKER, then the grammar (which
        starts at the marker) takes every token so far."""
        if self._kind == "text":
            self.done = self.free = True
        elif self._kind == "calls":
            self.watching = False
            head = self.emitted
            while head and self.vocab.texts[head[0]].strip() == "":
                head = head[1:]  # whitespace before the marker is not the grammar's
            if self.matcher.validate_tokens(head) != len(head) or not \
                    self.matcher.consume_tokens(head):
                self.done = self.free = True  # the marker ran into text the call can't take
                self._kind = "text"

    def _fail(self) -> None:
        self.failed = self.matcher.get_error() or "the grammar failed"
        self.done = True


# A JSON text's state: (arrays and objects open, inside a string, after a backslash).
_Scan = tuple[int, bool, bool]


def _scan(text: str, state: _Scan) -> _Scan:
    """The state after reading `text` in `state` (compact JSON, as the grammar writes it:
    only its strings hold brackets that do not count)."""
    depth, in_string, escaped = state
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
    return depth, in_string, escaped


def _open(state: _Scan) -> int:
    """How many values are open: the arrays and objects, and a string."""
    return state[0] + state[1]
