"""The output processor: a running request's tokens into the events of
inference/jobs.py (vLLM v1's OutputProcessor, with our stop rules).

Per token of a row: the end-of-sequence token ends it (stop, or tool_calls when its
grammar was writing calls); otherwise the token is detokenized incrementally
(inference/engine/detokenize.py), its logprobs entry taken from the runtime when the job asked
for them (inference/engine/logprobs.py), and the new text checked against the stop strings:
text is cut before the first stop string found, and anything that may be the start of
one is held back, so the caller never sees half a stop sequence. The row then ends at
its token budget (length), at its deadline (a 504), when its grammar's value is
complete, or on the model's numerical fault (FAILED: a 500 that is not retried).

Events: one `DeltaEvent` per token that completes text (a streamed request), or one at
the end (a request nobody reads token by token: `stream` false), the first (seq 0) with
the prompt's token count; then one final event,
a `DoneEvent` (finish, usage, tool calls, the stop string) or an `ErrorEvent`. Every
event goes to the `Outbox` (inference/engine/writer.py) with its sequence number; a
final event with the entry's acknowledgement. `handle` returns the rows that ended, for
the engine to drop.

Preemption (recompute, as vLLM's): `park` sets a running row aside whole (its tokens,
detokenizer, stop-string hold-back, grammar state, sequence numbers) once the engine has
handed out every token made for it; `unpark` makes the sequence that continues it (its
prompt and every token generated, prefilled again), so its stream only pauses. A parked
row that is cancelled or expires meanwhile ends through `finish_parked`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from inference import queue as q
from inference.engine.detokenize import Detokenizer
from inference.engine.entries import (
    Pending,
    RequestError,
    expired_in_generation,
    not_finite,
)
from inference.engine.logprobs import TokenTexts
from inference.engine.writer import Outbox
from inference.jobs import (
    DeltaEvent,
    DoneEvent,
    EmbeddingEvent,
    ErrorEvent,
    ToolCall,
    ToolDelta,
    usage,
)
from inference.runtimes.base import (
    FAILED,
    ChatRuntime,
    EmbeddingRuntime,
    NewSequence,
    SamplingParams,
)
from inference.structured.grammar import CUSTOM_END
from inference.structured.toolstream import CallText, read_calls

if TYPE_CHECKING:
    from inference.structured.constraint import Constraint


@dataclass
class Row:
    """A running request's output state."""

    pending: Pending
    prompt_tokens: int
    max_new: int
    stop: tuple[str, ...]
    ignore_eos: bool = False
    # Tool calls and structured outputs: the reply is generated under its grammar and
    # ends with the value (or the calls).
    constraint: Constraint | None = None
    cache_salt: str = ""  # the sequence's NewSequence.cache_salt
    logprobs: bool = False  # each token's entry goes out with it (`lp` of its delta)
    # False: nobody reads the reply token by token, so it goes out in one piece at the
    # end (per-token events would cost Redis writes and gateway work for nothing). A
    # failover then regenerates it from the start.
    streamed: bool = True
    ids: list[int] = field(default_factory=list)
    unsent_ids: list[int] = field(default_factory=list)
    unsent_lps: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""  # all text decoded so far
    sent_text: str = ""  # the part of it already streamed
    seq: int = 0
    detok: Detokenizer | None = None
    stopped_by: str = ""  # the stop string that ended the reply, if one did
    sent_args: list[str] = field(default_factory=list)  # each call's arguments streamed

    @property
    def req(self) -> q.QueuedRequest:
        return self.pending.req

    def resume(self, deltas: list[DeltaEvent]) -> None:
        """Continue after what an earlier delivery streamed (its delta events)."""
        for event in deltas:
            self.ids += event["ids"]
            self.sent_text += event["text"]
            self.seq = event["seq"] + 1
            for piece in event.get("tools", ()):
                if "name" in piece:
                    self.sent_args.append(piece["arguments"])
                else:
                    self.sent_args[piece["index"]] += piece["arguments"]
        self.text = self.sent_text


def done_event(seq: int, reason: str, *, prompt_tokens: int, completion_tokens: int,
               tool_calls: list[ToolCall] | None = None, stop_sequence: str = "",
               device_us: int = 0, cached_tokens: int = 0) -> DoneEvent:
    """A request's end. `stop_sequence`: the stop string that ended the reply
    (Anthropic's Messages API names it; finish stays "stop"); `device_us`: its share of
    the model's step time (inference/engine/engine.py); `cached_tokens`: its prompt
    tokens the model did not compute (Usage)."""
    event: DoneEvent = {"t": "done", "seq": seq, "finish": reason,
                        "usage": usage(prompt_tokens, completion_tokens, device_us,
                                       cached_tokens)}
    if tool_calls:
        event["tool_calls"] = tool_calls
    if stop_sequence:
        event["stop_sequence"] = stop_sequence
    return event


def error_event(exc: RequestError, *, seq: int = 0, cost: tuple[int, int] = (0, 0)
                ) -> ErrorEvent:
    """A request's end in failure; `cost`: (prompt, completion) tokens spent on it."""
    event: ErrorEvent = {"t": "error", "seq": seq, "status": exc.status, "code": exc.code,
                         "message": exc.message, "usage": usage(*cost)}
    if not exc.retry:
        event["retry"] = False
    return event


class OutputProcessor:
    def __init__(self, outbox: Outbox, runtime: ChatRuntime | EmbeddingRuntime,
                 device_s: Callable[[str], float] | None = None) -> None:
        """`device_s(rid)`: the seconds of step time a finishing request was given (the
        engine's `take_device_s`), reported in its final event's usage."""
        self.outbox = outbox
        self._device_s = device_s
        self.rows: dict[str, Row] = {}  # the running requests, by request id
        self.parked: dict[str, Row] = {}  # rows preempted, waiting to run again
        # Each tracked row's prompt and sampling parameters (a parked row restarts).
        self._inputs: dict[str, tuple[list[int], SamplingParams]] = {}
        self._runtime = runtime
        self._eos = runtime.eos_token_ids if isinstance(runtime, ChatRuntime) else frozenset()
        self._token_texts: TokenTexts | None = None  # made on first use

    # -- rows ----------------------------------------------------------------------
    def start(self, row: Row, prompt: list[int], params: SamplingParams) -> NewSequence | None:
        """Track `row` and return the sequence the engine runs for it: its prompt, then
        what it already holds (a resumed row's tokens, as context). None when nothing is
        left to generate: its final event is in the outbox already."""
        constraint = row.constraint
        if constraint is not None:
            constraint.replay(row.ids)  # resumed: what was streamed was written under it
            if constraint.complete:
                self._finish(row, "tool_calls" if constraint.kind() == "calls" else "stop")
                return None
        left = row.max_new - len(row.ids)
        if left <= 0:
            self._finish(row, "length")
            return None
        runtime = self._runtime
        assert isinstance(runtime, ChatRuntime)  # noqa: S101
        row.detok = Detokenizer(runtime.decode, row.ids)
        if row.sent_args:  # resumed in the middle of its calls: their text is not content
            row.text = runtime.decode(row.ids)
        self.rows[row.req.rid] = row
        self._inputs[row.req.rid] = (prompt, params)
        return NewSequence(row.req.rid, prompt + row.ids, replace(params, max_tokens=left),
                           generated=len(row.ids), constraint=constraint,
                           cache_salt=row.cache_salt)

    def park(self, rid: str) -> Pending:
        """Set running row `rid` aside (preempted); returns its entry. Precondition:
        every token made for it was handled, and it has left the engine."""
        row = self.rows.pop(rid)
        self.parked[rid] = row
        return row.pending

    def unpark(self, rid: str) -> NewSequence:
        """Track parked row `rid` again and return the sequence that continues it."""
        row = self.parked.pop(rid)
        self.rows[rid] = row
        prompt, params = self._inputs[rid]
        return NewSequence(rid, prompt + row.ids,
                           replace(params, max_tokens=row.max_new - len(row.ids)),
                           generated=len(row.ids), constraint=row.constraint,
                           cache_salt=row.cache_salt)

    def finish_parked(self, rid: str, reason: str) -> Pending:
        """End parked row `rid` (`reason` as for `finish`, or "deadline"); returns its
        entry (the caller takes it out of the backlog)."""
        row = self.parked.pop(rid)
        self._finish(row, reason)
        return row.pending

    def expired_parked(self, now_ms: int) -> list[str]:
        """The parked rows whose deadline is `now_ms` or earlier."""
        return [rid for rid, row in self.parked.items() if row.req.deadline_ms <= now_ms]

    def handle(self, tokens: dict[str, int]) -> list[str]:
        """One step's tokens (request id -> token, FAILED for a model fault); returns
        the request ids of the rows that ended."""
        ended = []
        for rid, token in tokens.items():
            row = self.rows.get(rid)
            if row is not None and self._on_token(row, token):
                ended.append(rid)
        return ended

    def finish(self, rid: str, reason: str) -> None:
        """End a running row now (`reason`: its finish, e.g. "cancelled")."""
        self._finish(self.rows[rid], reason)

    def fail(self, rid: str, exc: RequestError) -> None:
        """End a row that never ran (the engine refused it) with `exc`'s error event; its
        cost is what earlier deliveries generated, if any."""
        row = self.rows.pop(rid)
        self._inputs.pop(rid, None)
        cost = (row.prompt_tokens, len(row.ids)) if row.ids else (0, 0)
        self.outbox.final(row.pending, error_event(exc, seq=row.seq, cost=cost))

    def clear(self) -> None:
        """Forget every row, running or parked (their entries were handed back)."""
        self.rows.clear()
        self.parked.clear()
        self._inputs.clear()

    def embedded(self, pending: Pending, vectors: list[list[float]], prompt_tokens: int,
                 *, labels: list[str] | None = None) -> None:
        """An embedding request's vectors (a classifier's probabilities, per its
        `labels`): its embedding event and its final event, or a 500 when the model's
        output was not finite."""
        # A vector is finite iff its sum is (floats; the check is C-speed).
        if not all(math.isfinite(sum(v)) for v in vectors):
            self.outbox.final(pending, error_event(not_finite(pending.req.rid, "embeddings")))
            return
        event: EmbeddingEvent = {"t": "embedding", "seq": 0, "data": vectors}
        if labels is not None:
            event["labels"] = labels
        self.outbox.add(pending.req, event)
        self.outbox.final(pending, done_event(1, "stop", prompt_tokens=prompt_tokens,
                                              completion_tokens=0))

    # -- per token -----------------------------------------------------------------
    def _on_token(self, row: Row, token: int) -> bool:
        """Handle one token; True when it ended the row."""
        if token == FAILED:
            return self._finish(row, "model_error")
        constraint = row.constraint
        if token in self._eos and not row.ignore_eos:
            calls = constraint is not None and constraint.kind() == "calls"
            return self._finish(row, "tool_calls" if calls else "stop")
        row.ids.append(token)
        row.unsent_ids.append(token)
        if row.logprobs:
            self._logprob(row, token)
        assert row.detok is not None  # noqa: S101
        row.text += row.detok.push(token)
        if constraint is not None and constraint.complete \
                and len(row.ids) >= len(constraint.emitted):
            # The whole value (or every call) is out: the constraint may be a token ahead
            # of the tokens handled here (an overlapped step's), so it ends with its last.
            return self._finish(row, "tool_calls" if constraint.kind() == "calls" else "stop")
        if _cut_at_stop(row):
            return self._finish(row, "stop", flush=False)
        self._emit_text(row, final=False)
        if len(row.ids) >= row.max_new:
            return self._finish(row, "length")
        if row.req.deadline_ms <= q.now_ms():
            return self._finish(row, "deadline")
        return False

    def _logprob(self, row: Row, token: int) -> None:
        runtime = self._runtime
        assert isinstance(runtime, ChatRuntime)  # noqa: S101
        logprob = runtime.pop_logprob(row.req.rid)
        if logprob is None:
            return  # a runtime that has none (echo)
        if self._token_texts is None:
            self._token_texts = TokenTexts(runtime)
        row.unsent_lps.append(self._token_texts.entry(token, logprob))

    def _emit_text(self, row: Row, *, final: bool) -> None:
        if row.constraint is not None and row.constraint.kind() != "text":
            # A tool call (or maybe the start of one) is not content.
            if row.streamed and not final and row.constraint.kind() == "calls":
                self._emit_calls(row, read_calls(row.text))
            return
        text = row.text
        if not final:
            if not row.streamed:
                return
            # Hold back anything that may be the start of a stop string.
            for stop in row.stop:
                for n in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:n]):
                        text = text[:-n]
                        break
        delta = text[len(row.sent_text):]
        if not delta and not (final and row.unsent_ids):
            return
        event: DeltaEvent = {"t": "delta", "seq": row.seq, "text": delta,
                             "ids": row.unsent_ids}
        if row.logprobs:
            event["lp"], row.unsent_lps = row.unsent_lps, []
        row.sent_text = text
        self._send(row, event)

    def _emit_calls(self, row: Row, calls: list[CallText]) -> None:
        """Stream what is new of the calls being written: a call's id and name once its
        name is complete, then each new piece of its arguments."""
        pieces: list[ToolDelta] = []
        for k, call in enumerate(calls):
            if k == len(row.sent_args):
                row.sent_args.append(call.arguments)
                pieces.append({"index": k, "id": _call_id(row.req.rid, k), "name": call.name,
                               "arguments": call.arguments})
                continue
            sent = row.sent_args[k]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                row.sent_args[k] = call.arguments
                pieces.append({"index": k, "arguments": call.arguments[len(sent):]})
        if pieces:
            self._send(row, {"t": "delta", "seq": row.seq, "text": "", "ids": row.unsent_ids,
                             "tools": pieces})

    def _cached(self, row: Row) -> int:
        """How many of `row`'s prompt tokens the runtime did not compute (Usage)."""
        runtime = self._runtime
        return (min(runtime.cached_tokens(row.req.rid), row.prompt_tokens)
                if isinstance(runtime, ChatRuntime) else 0)

    def _send(self, row: Row, event: DeltaEvent) -> None:
        if row.seq == 0:
            event["prompt_tokens"] = row.prompt_tokens
            cached = self._cached(row)
            if cached:
                event["cached_tokens"] = cached
        self.outbox.add(row.req, event)
        row.seq += 1
        row.unsent_ids = []

    def _finish(self, row: Row, reason: str, *, flush: bool = True) -> bool:
        """End `row`: the text held back goes out, then its final event. True."""
        if flush and row.detok is not None:
            # Text the detokenizer still held (a character split across tokens) goes
            # out, less a character the generation stopped inside.
            row.text += row.detok.flush()
            if _cut_at_stop(row) and reason == "length":
                reason = "stop"
        self._emit_text(row, final=True)  # whatever was held back, if anything
        self.rows.pop(row.req.rid, None)
        self._inputs.pop(row.req.rid, None)
        device_us = (round(self._device_s(row.req.rid) * 1e6)
                     if self._device_s is not None else 0)
        cached = self._cached(row)
        pending, cost = row.pending, (row.prompt_tokens, len(row.ids))
        constraint = row.constraint
        if reason == "length" and constraint is not None and constraint.kind() == "calls" \
                and constraint.accepting():
            reason = "tool_calls"  # the budget ended with the last call: every call is whole
        if reason in ("tool_calls", "length") and constraint is not None \
                and constraint.kind() == "calls":
            calls = self._calls(row, cut=reason == "length")
            # Seen one token ahead (an overlapped step), the call's last token is in
            # the constraint but not yet in ids.
            self.outbox.final(pending, done_event(
                row.seq, reason, prompt_tokens=row.prompt_tokens,
                completion_tokens=max(len(row.ids), len(constraint.emitted)),
                tool_calls=calls, device_us=device_us,
                cached_tokens=cached))
        elif reason == "deadline":
            self.outbox.final(pending, error_event(expired_in_generation(), seq=row.seq,
                                                   cost=cost))
        elif reason == "model_error":
            self.outbox.final(pending, error_event(not_finite(row.req.rid, "logits"),
                                                   seq=row.seq, cost=cost))
        else:
            self.outbox.final(pending, done_event(
                row.seq, reason, prompt_tokens=row.prompt_tokens,
                completion_tokens=len(row.ids), stop_sequence=row.stopped_by,
                device_us=device_us, cached_tokens=cached))
        return True


    def _calls(self, row: Row, *, cut: bool = False) -> list[ToolCall]:
        """The calls of a reply that ended writing them, their arguments as the model
        wrote them (what was streamed, the rest streamed now). `cut`: the reply ran out
        of tokens: the last call is listed with its arguments so far (not valid JSON),
        as OpenAI lists a call cut by max_tokens; none when its name was not complete."""
        constraint = row.constraint
        assert constraint is not None  # noqa: S101
        # The constraint holds every token of the calls (the row may be one behind).
        vocab = constraint.vocab
        text = vocab.decode([t for t in constraint.emitted if t not in vocab.eos])
        written = read_calls(text)
        found = [(c.name, c.arguments) for c in written if c.complete or cut]
        if cut:
            if row.streamed:
                self._emit_calls(row, written)
        elif len(found) != len(written) or not found or (CUSTOM_END in text and any(
                CUSTOM_END in arguments for _name, arguments in constraint.calls())):
            # Not of the grammar's usual shape, or a custom input that holds
            # CUSTOM_END (which the reader took for its end): whole.
            found = constraint.calls()
        elif row.streamed:
            self._emit_calls(row, written)
        return [{"id": _call_id(row.req.rid, i), "name": name, "arguments": arguments}
                for i, (name, arguments) in enumerate(found)]


def _call_id(rid: str, index: int) -> str:
    return f"call_{rid[:20]}" if index == 0 else f"call_{rid[:20]}_{index}"


def _cut_at_stop(row: Row) -> bool:
    """Cut the text before the first stop string in it, if any (only its new tail can
    complete one)."""
    if not row.stop:
        return False
    start = max(0, len(row.sent_text) - max(map(len, row.stop)))
    hits = [(i, s) for s in row.stop if (i := row.text.find(s, start)) >= 0]
    if hits:
        cut, row.stopped_by = min(hits)
        row.text = row.text[:cut]
    return bool(hits)
