"""The engine: a runtime's sequences and the decode steps that advance them.

Contract with the loop (the only caller; one thread):
- `add(seqs)` starts the sequences the runtime's KV cache can hold (their prefill) and
  returns the others with the runtime's `KVRefusal`; the first tokens of those started
  come out of the next `step()`, after the tokens of the step that ended as they joined;
- `step()` yields the batch's next tokens ({request id: token}, FAILED for a row the
  model failed on), in order, in up to three dicts; the caller handles each before it
  asks for the next, and `drop`s what finished meanwhile;
- `drop(rids)` takes finished sequences out of the runtime;
- `pause(rids)` is the barrier before a preemption: it returns the tokens those
  sequences made and were not handed out yet (the caller handles them, then `drop`s
  the sequences), so what the runtime computed for them is neither lost nor seen twice;
- `settle()` ends a step still running when the batch has ended; `abandon()` forgets
  every sequence; `close()` drops every sequence and ends the model thread;
  `embed(texts)` is an embedding runtime's whole batch.

Overlap (vLLM's asynchronous scheduling): steps at least `overlap_min_step_s` long (a
model's forward pass) run on the model thread, the next one starting as soon as the
previous one has ended, while the loop handles the previous step's tokens, writes,
reads, admits. The batch's pace is then the model's, not the model's plus the loop's.
The runtime is only touched between steps: a sequence dropped during a step leaves
after it (it computed one token too many, never seen), newcomers join at the next
barrier. The sampler advances grammar constraints on the model thread, so the loop may
see a constraint one token ahead of the token it handles (the output processor allows
for it). A shorter step (the echo runtime without delay) runs inline, where a thread
handoff would cost more than it hides.

Device time (`take_device_s`): each step's time is split evenly among the sequences it
advanced, a prefill's among the sequences it started by prompt length; on a GPU the
step ends with its tokens on the host, so its time is the device's, on a CPU it is the
step's wall time. What a request was given is priced by `gpu_second_usd`.

Newcomers' first tokens (their prefill's) are handled after the tokens of the step that
ended as they joined: a batch's events keep one order from step to step, newcomers
last (ahead of the batch, a newcomer's first token went out first in its wave and its
second last in the next one, and its first gap carried a whole fan-out).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from inference.runtimes.base import ChatRuntime, EmbeddingRuntime, KVRefusal, NewSequence

Tokens = dict[str, int]
OVERLAP_MIN_STEP_S = 0.001
_EMBED_CHUNK = 64  # texts per embedding forward pass


class Engine:
    def __init__(self, runtime: ChatRuntime | EmbeddingRuntime, *,
                 overlap_min_step_s: float = OVERLAP_MIN_STEP_S) -> None:
        self.runtime = runtime
        self.overlap_min_step_s = overlap_min_step_s  # steps shorter than this run inline
        self.overlapped = 0  # steps started on the model thread (tests, debugging)
        self.rows: set[str] = set()  # the sequences in the runtime, not yet dropped
        self._model = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-model")
        # The step running on the model thread, if any; the tokens of one that has
        # ended and not been handed out; the sequences dropped while it ran (they leave
        # the runtime once it has ended); newcomers' first tokens; the last step's time.
        self._stepping: Future[Tokens] | None = None
        self._stepped: Tokens | None = None
        self._dropping: list[str] = []
        self._firsts: Tokens = {}
        self._step_s = 0.0
        self._device_s: dict[str, float] = {}  # each sequence's share of step time so far

    @property
    def chat(self) -> ChatRuntime:
        runtime = self.runtime
        assert isinstance(runtime, ChatRuntime)  # noqa: S101
        return runtime

    def add(self, seqs: Sequence[NewSequence]) -> list[tuple[NewSequence, KVRefusal]]:
        """Start `seqs` (their prefill runs now, at a barrier between steps), those the
        runtime's KV cache can hold beside the running ones; returns the others, each
        with the runtime's reason (the caller answers them)."""
        if not seqs:
            return []
        self.collect()  # rows that ended during the running step leave first
        chat = self.chat
        accepted: list[NewSequence] = []
        refused: list[tuple[NewSequence, KVRefusal]] = []
        for seq in seqs:
            refusal = chat.kv_admission(seq, accepted)
            if refusal is None:
                accepted.append(seq)
            else:
                refused.append((seq, refusal))
        if accepted:
            started = time.perf_counter()
            self._firsts.update(chat.add(accepted))
            self._share(time.perf_counter() - started,
                        {seq.rid: max(1, len(seq.prompt_ids)) for seq in accepted})
            self.rows.update(seq.rid for seq in accepted)
        return refused

    def step(self) -> Iterator[Tokens]:
        """The batch's next tokens, in order: those of the step that ended, then the
        newcomers' first tokens, then (a step run inline) this step's. An overlapped
        step is started before the first dict is handed out and its tokens come out of
        the next call."""
        self.collect()
        tokens, self._stepped = self._stepped, None
        firsts, self._firsts = self._firsts, {}
        # No step ahead when every row has made its last token (max_tokens): it would
        # only delay the next prefill (the barrier waits for it).
        overlap = bool(self.rows) and self._step_s >= self.overlap_min_step_s \
            and not (isinstance(self.runtime, ChatRuntime) and self.runtime.exhausted())
        if overlap:
            self._stepping = self._model.submit(self._timed_step)
            self.overlapped += 1
        yield tokens or {}
        yield firsts
        if not overlap and tokens is None and self.rows:
            tokens = self._timed_step()
            self._share(self._step_s, dict.fromkeys(tokens, 1))
            yield tokens

    def take_device_s(self, rid: str) -> float:
        """The seconds of step time `rid` was given (see the module's docstring), once:
        the request's final event reports them."""
        return self._device_s.pop(rid, 0.0)

    def _share(self, seconds: float, weights: dict[str, int], total: int = 0) -> None:
        """`seconds` split among `weights`' sequences by weight (of `total`, when some
        that took part are not among them)."""
        total = total or sum(weights.values())
        for rid, weight in weights.items():
            self._device_s[rid] = self._device_s.get(rid, 0.0) + seconds * weight / total

    def drop(self, rids: Iterable[str]) -> None:
        """Take finished sequences out of the runtime: now, or after the running step."""
        rids = list(rids)
        self.rows.difference_update(rids)
        if self._stepping is not None:
            self._dropping += rids
        elif rids:
            self.chat.drop(rids)

    def pause(self, rids: Iterable[str]) -> list[Tokens]:
        """Wait for the running step, then take out of what is not handed out yet the
        tokens of `rids`, in order (the step's, then their first tokens): the caller
        handles them before it drops the sequences."""
        rids = list(rids)
        self.collect()
        out: list[Tokens] = []
        for held in (self._stepped, self._firsts):
            if held:
                out.append({rid: held.pop(rid) for rid in rids if rid in held})
        return out

    def collect(self) -> None:
        """The barrier: wait for the step running on the model thread, if any, keep its
        tokens for `step` and drop the sequences that finished while it ran. A model
        error is raised here, as an inline step would raise it."""
        if self._stepping is None:
            return
        stepping, self._stepping = self._stepping, None
        tokens = stepping.result()
        advanced = len(tokens)
        if self._dropping:
            gone = set(self._dropping)
            self.chat.drop(self._dropping)
            self._dropping = []
            tokens = {rid: token for rid, token in tokens.items() if rid not in gone}
        # A sequence that ended meanwhile has reported its time: its share is nobody's.
        self._share(self._step_s, dict.fromkeys(tokens, 1), total=advanced)
        self._stepped = tokens

    def settle(self) -> None:
        """The batch has ended: end the step still running (its tokens are nobody's)."""
        self.collect()
        self._stepped = None

    def abandon(self) -> None:
        """Forget every sequence (after a failure): the running step's result and
        error are ignored; the runtime drops them all."""
        if self._stepping is not None:
            with contextlib.suppress(Exception):  # the failure is what is abandoned
                self._stepping.result()
            self._stepping = None
        self._stepped, self._firsts = None, {}
        self._device_s.clear()
        if isinstance(self.runtime, ChatRuntime):
            self.runtime.drop([*self.rows, *self._dropping])
        self._dropping = []
        self.rows.clear()

    def close(self, *, wait: bool) -> None:
        """Stop: every sequence leaves the runtime, then the model thread ends. A runtime
        may outlive its engine (a worker restarted in the same process, a test's shared
        runtime): it is left empty, its KV cache free. With `wait` False a step still
        running is not waited for, and the runtime, which it is using, is left as is."""
        if wait or self._stepping is None or self._stepping.done():
            self.abandon()
        self._model.shutdown(wait=wait)

    def embed(self, texts: Sequence[str]) -> tuple[list[list[float]], list[int]]:
        """One vector and one token count per text, in order (forward passes of up to
        _EMBED_CHUNK texts)."""
        runtime = self.runtime
        assert isinstance(runtime, EmbeddingRuntime)  # noqa: S101
        vectors: list[list[float]] = []
        counts: list[int] = []
        for start in range(0, len(texts), _EMBED_CHUNK):
            v, c = runtime.embed(texts[start:start + _EMBED_CHUNK])
            vectors += v
            counts += c
        return vectors, counts

    def _timed_step(self) -> Tokens:
        started = time.perf_counter()
        tokens = self.chat.step()
        self._step_s = time.perf_counter() - started
        return tokens
