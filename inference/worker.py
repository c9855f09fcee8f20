"""The worker: pulls dynamic batches from a deployment's Redis stream, runs the model,
streams results back, and acknowledges. One process per worker; run it with
`manage.py runworker --deployment NAME` or `python -m inference.worker --spec JSON`.

Per iteration:
  heartbeat -> reap stale entries of dead workers -> pull -> cancellations -> admit
  (fair, by priority) -> one decode step for the running batch -> publish + ack.
When steps are long (a model's forward pass), the next step runs on the model thread
while this thread does all of that for the previous one (see `_decode_step`).

Delivery is at-least-once with no duplicates visible to the caller:
- every event carries a sequence number, and is written to the request's own stream
  before the entry is acknowledged;
- a worker that takes over a request (after the first one died) reads what was already
  streamed, feeds those tokens back as context and continues from there;
- the `done` marker is set once (SET NX), so only one final event (one charge) exists;
- an entry delivered more than `max_deliveries` times goes to the dead-letter stream and
  its caller gets a clear error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from secrets import token_hex
from typing import TYPE_CHECKING, Any

import redis
from opentelemetry.trace import Link, Span, SpanKind

from inference import queue as q
from inference.detokenize import Detokenizer
from inference.jobs import (
    FINAL_EVENTS,
    ChatJob,
    DeltaEvent,
    DoneEvent,
    EmbedJob,
    ErrorEvent,
    Event,
    JobError,
    ToolCall,
    default_max_tokens,
    encode_event,
    usage,
)
from inference.memory import MemoryGuard
from inference.runtimes import load_runtime
from inference.runtimes.base import (
    FAILED,
    ChatRuntime,
    EmbeddingRuntime,
    NewSequence,
    SamplingParams,
    TorchModel,
)
from inference.scheduler import pick
from inference.spec import DeploymentSpec
from sluice import gctuning, telemetry
from sluice.processes import set_on_signals
from sluice.redis import ScriptBatch, chunks, reconnecting

if TYPE_CHECKING:
    from inference.constraint import Constraint

logger = logging.getLogger("sluice.worker")
_EMBED_CHUNK = 64
_RELEASE_IDLE_MS = 10**9  # "idle forever": the next reaper takes it at once
_IDLE_POLL_S = 0.05  # how often the list of streams is read (a new one shows within 2x)
_CANCEL_CHECK_S = 0.05  # how often cancellations are looked up (bounds their latency)
_CLEANUP_S = 60.0  # an empty stream is forgotten after one to two of these
# A step at least this long runs on the model thread, overlapped with the host's work
# for the previous one; a shorter one (the echo runtime without delay) runs inline,
# where a thread handoff would cost more than it hides.
_OVERLAP_MIN_STEP_S = 0.001


@dataclass
class Pending:
    stream: str  # the stream suffix ("<tenant>:<priority>")
    msg_id: str
    req: q.QueuedRequest
    deliveries: int = 1

    @property
    def tenant(self) -> str:
        return self.req.tenant

    @property
    def priority(self) -> int:
        return self.req.priority


@dataclass
class Active:
    pending: Pending
    prompt_tokens: int
    max_new: int
    stop: tuple[str, ...]
    ignore_eos: bool = False
    # Tool calls and structured outputs: the reply is generated under its grammar and
    # ends with the value (or the calls).
    constraint: Constraint | None = None
    # OpenAI's logprobs: each token's entry goes out with it (`lp` in its delta event).
    logprobs: bool = False
    # False: nobody reads the reply token by token, so it goes out in one piece at the
    # end (a non-streaming call's per-token events would cost Redis writes and gateway
    # work for nothing). A failover then regenerates it from the start.
    streamed: bool = True
    ids: list[int] = field(default_factory=list)
    unsent_ids: list[int] = field(default_factory=list)
    unsent_lps: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""  # all text decoded so far
    sent_text: str = ""  # the part of it already streamed
    seq: int = 0
    detok: Detokenizer | None = None
    stopped_by: str = ""  # the stop string that ended the reply, if one did

    @property
    def req(self) -> q.QueuedRequest:
        return self.pending.req


@dataclass
class BatchSpan:
    """A batch's span: open until the last request it admitted has its final event."""

    span: Span
    open: set[str]


class RequestError(Exception):
    """A request's error event. `retry=False`: the same request would fail the same way
    again (the gateway tells clients not to retry it: `x-should-retry: false`)."""

    def __init__(self, status: int, code: str, message: str, *, retry: bool = True) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry = status, code, message, retry


def _not_finite(rid: str, output: str) -> RequestError:
    """A model's numerical fault on one request's input (its `output`, logits or
    embeddings, held NaN or infinity). Deterministic for that input: the request would
    fail again anywhere, so it is answered now with a 500, neither retried nor allowed
    to stop the worker and the rest of its batch."""
    logger.error("request %s: the model's %s were not finite", rid, output)
    return RequestError(500, "model_error", f"The model's output for this request was "
                        f"not a number (NaN or infinite {output}).", retry=False)


class Worker:
    def __init__(
        self,
        spec: DeploymentSpec,
        client: redis.Redis,
        *,
        runtime: ChatRuntime | EmbeddingRuntime | None = None,
        worker_id: str | None = None,
        block_ms: int = 1000,
        heartbeat_s: float = 1.0,
        reclaim_after_ms: int | None = None,
        overlap_min_step_s: float = _OVERLAP_MIN_STEP_S,
    ) -> None:
        self.spec = spec
        self.redis = client
        self.runtime = runtime if runtime is not None else load_runtime(spec)
        self.id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{token_hex(3)}"
        self.block_ms = block_ms
        self.heartbeat_s = heartbeat_s
        self.overlap_min_step_s = overlap_min_step_s  # steps shorter than this run inline
        self.overlapped = 0  # steps started on the model thread (tests, debugging)
        # Entries idle longer than this belong to a dead worker and may be taken over.
        # It must sit above the p99 batch time: live workers refresh their own entries
        # every third of it.
        self.reclaim_after_ms = reclaim_after_ms or int(str(spec.extra.get("reclaim_after_ms",
                                                                           30000)))
        self.window = spec.max_batch_size * 2
        self._eos = self.runtime.eos_token_ids if isinstance(self.runtime, ChatRuntime) \
            else frozenset()
        self._vocab: Any = None  # a Vocabulary, built on the first constrained request
        self._token_texts: Any = None  # a logprobs.TokenTexts, made on first use
        self._cleanup = self.redis.register_script(q.CLEANUP_LUA)
        self.backlog: list[Pending] = []
        self.active: dict[str, Active] = {}
        self.stopping = threading.Event()
        self._outbox: list[tuple[q.QueuedRequest, Event]] = []
        self._acks: list[Pending] = []
        self._last_tenant: str | None = None
        self._next_heartbeat = 0.0
        self._next_reap = 0.0
        self._next_cancel_check = 0.0
        self._next_cleanup = time.monotonic() + _CLEANUP_S
        self._idle_seen: set[str] = set()
        self._streams_seen: list[str] = []  # the deployment's streams, as last read
        self._streams_fresh_until = 0.0
        self._next_join_read = 0.0  # a running batch's next read for newcomers
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-writer")
        self._writing: Future[None] | None = None
        # The decode step running on the model thread, if any; the tokens of one that
        # has ended but whose tokens are not handled yet; the sequences that finished
        # while it ran (dropped from the runtime once it has ended); the last step's time.
        self._model = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-model")
        self._stepping: Future[dict[str, int]] | None = None
        self._stepped: dict[str, int] | None = None
        self._dropping: list[str] = []
        self._firsts: dict[str, int] = {}  # newcomers' first tokens, handled with the step's
        self._step_s = 0.0
        self.batches = 0
        self.batch_sizes: dict[int, int] = {}  # not yet reported (heartbeat sends them)
        self._batch_of: dict[str, BatchSpan] = {}
        self.guard = MemoryGuard()
        self._others_in_rotation = False
        self._alone: str | None = None  # a request on its last chance, running alone
        # The request ids of the most recent admissions, for tests and debugging.
        self.admitted: deque[list[str]] = deque(maxlen=256)

    # -- life cycle ----------------------------------------------------------------
    def run(self, *, drain_s: float = 10.0) -> None:
        logger.info("worker %s serving %s", self.id, self.spec.name)
        try:
            while not self.stopping.is_set():
                try:
                    self.iterate()
                except redis.RedisError:
                    logger.exception("Redis failed; dropping local work, it will be resumed")
                    self._abandon()
                    self.stopping.wait(1.0)
        except Exception:
            # Crash-only (a model or CUDA error may leave this process unusable), but
            # the requests need not wait reclaim_after_ms for a reaper to notice.
            logger.exception("worker %s failed; handing its requests back", self.id)
            self._hand_back()
            raise
        self._drain(drain_s)

    def _hand_back(self) -> None:
        """After a failure: write what was already made (a takeover resumes after it),
        then release every request held, as a drain does, for the next reap of any
        live worker (within a third of its reclaim_after_ms) instead of after
        reclaim_after_ms of silence."""
        with contextlib.suppress(Exception):
            self._flush(wait=True)
        with contextlib.suppress(redis.RedisError):
            self._release(self.backlog)  # waiting: not part of what failed
            self._release([a.pending for a in self.active.values()], failed=True)
        self._end_batches("failed")
        self._writer.shutdown(wait=False)
        self._model.shutdown(wait=False)

    def _abandon(self) -> None:
        """Forget everything held locally. The entries stay pending in Redis, so after
        reclaim_after_ms a worker (this one too) takes them over and resumes each from
        the events that did reach its stream: nothing is lost or repeated."""
        if self._writing is not None:
            with contextlib.suppress(Exception):
                self._writing.result()
            self._writing = None
        if self._stepping is not None:
            with contextlib.suppress(Exception):
                self._stepping.result()
            self._stepping = None
        self._stepped = None
        self._firsts = {}
        if isinstance(self.runtime, ChatRuntime):
            self.runtime.drop([*self.active, *self._dropping])
        self._dropping = []
        self.active.clear()
        self.backlog.clear()
        self._outbox, self._acks = [], []
        self._end_batches("abandoned")

    def _drain(self, drain_s: float) -> None:
        """Finish what is running (up to drain_s), hand everything else back."""
        deadline = time.monotonic() + drain_s
        self._release([p for p in self.backlog])
        self.backlog.clear()
        while self.active and time.monotonic() < deadline:
            self._decode_step()
            self._flush()
        self._collect()  # a step still running: its tokens go unhandled, released below
        self._flush(wait=True)
        self._release([a.pending for a in self.active.values()])
        self.active.clear()
        self._end_batches("released")
        self._writer.shutdown(wait=True)
        self._model.shutdown(wait=True)
        self.redis.hdel(q.workers_key(self.spec.name), self.id)

    def _release(self, pendings: list[Pending], *, failed: bool = False) -> None:
        """Hand entries back. XCLAIM with a huge IDLE makes them look abandoned: the
        next reaper of any live worker takes them over at once (and resumes their
        output). Unless `failed` (they were in a batch that failed), their delivery
        count is set back by the delivery that did not run to its end, so a request
        only nears `max_deliveries` (the dead letters) by failing, not by waiting in
        the backlog of a worker that failed or stopped."""
        groups: dict[tuple[str, int], list[str]] = {}
        for pending in pendings:
            count = pending.deliveries if failed else max(0, pending.deliveries - 1)
            groups.setdefault((pending.stream, count), []).append(pending.msg_id)
        for (suffix, count), ids in groups.items():
            self.redis.xclaim(self._key(suffix), q.GROUP, "released", 0, ids,
                              idle=_RELEASE_IDLE_MS, justid=True, retrycount=count)

    def _key(self, suffix: str) -> str:
        return q.stream_key(self.spec.name, suffix)

    def _forget_empty_streams(self) -> None:
        """Streams at zero for a whole cleanup period go (new requests recreate them)."""
        counts = {_s(k): int(v) for k, v in self.redis.hgetall(
            q.streams_key(self.spec.name)).items()}
        for suffix in [s for s, n in counts.items() if n <= 0 and s in self._idle_seen]:
            self._cleanup(keys=[self._key(suffix), q.streams_key(self.spec.name)],
                          args=[suffix])
        self._idle_seen = {s for s, n in counts.items() if n <= 0}

    def _streams(self) -> list[str]:
        """The suffixes of the streams that hold requests right now."""
        return [_s(s) for s in self.redis.hkeys(q.streams_key(self.spec.name))]

    def iterate(self) -> None:
        now = time.monotonic()
        if now >= self._next_heartbeat:
            self._heartbeat()
            self._next_heartbeat = now + self.heartbeat_s
        if now >= self._next_reap:
            self._refresh_claims()
            self._reap()
            self._next_reap = now + self.reclaim_after_ms / 3000
        if now >= self._next_cleanup:
            self._forget_empty_streams()
            self._next_cleanup = now + _CLEANUP_S
        self._pull()
        if now >= self._next_cancel_check:
            self._cancellations()
            self._next_cancel_check = now + _CANCEL_CHECK_S
        self._admit()
        if self.active:
            self._decode_step()
        self._flush()
        if not self.active:
            # The batch has ended (or was cancelled whole before its step was handled):
            # free its sequences now, not after the next read (which may block for
            # block_ms). Its finals are written already; the last step's tokens are
            # nobody's.
            self._collect()
            self._stepped = None

    # -- pulling -------------------------------------------------------------------
    def _read(self, room: int, block_ms: int | None) -> list[Pending]:
        """New entries from every non-empty stream at once, a fair share of `room` each."""
        now = time.monotonic()
        if now >= self._streams_fresh_until:
            self._streams_seen = self._streams()
            # The list is reused for _IDLE_POLL_S, blocking reads included (a read per
            # decode step or per wave of requests would otherwise cost two round trips):
            # a new tenant's stream shows within 2 x _IDLE_POLL_S at worst.
            self._streams_fresh_until = now + _IDLE_POLL_S
        suffixes = self._streams_seen
        if not suffixes:
            if block_ms:
                time.sleep(_IDLE_POLL_S)
            return []
        per_stream = max(1, room // len(suffixes))
        # A new tenant's stream is not among those we block on: bound the block so the
        # list is read again soon.
        block = min(block_ms, int(_IDLE_POLL_S * 1000)) if block_ms else None
        try:
            reply = self.redis.xreadgroup(q.GROUP, self.id,
                                          {self._key(s): ">" for s in suffixes},
                                          count=per_stream, block=block)
        except redis.ResponseError as exc:
            # A stream emptied and went away meanwhile (before or during our block).
            if "NOGROUP" in str(exc) or "UNBLOCKED" in str(exc):
                self._streams_fresh_until = 0.0
                return []
            raise
        out = []
        prefix = len(self._key(""))
        for stream, entries in reply or []:
            suffix = _s(stream)[prefix:]
            for msg_id, fields in entries:
                out.append(Pending(suffix, _s(msg_id), q.QueuedRequest.from_fields(fields)))
        return out

    def _pull(self) -> None:
        room = self.window - len(self.backlog) - len(self.active)
        if room <= 0:
            return
        if not self.guard.in_rotation:
            # Out of rotation (memory above the high-water mark): finish what runs and
            # take nothing new while another worker is in rotation. When none is, the
            # gateways degrade (shorter max_tokens) and this worker serves at a quarter
            # of its batch, rather than leaving the queue to time out.
            room = min(room, max(1, self.spec.max_batch_size // 4) - len(self.active)
                       - len(self.backlog))
            if self._others_in_rotation or room <= 0:
                if not self.active and not self.backlog:
                    self.stopping.wait(_IDLE_POLL_S)
                return
        if self.active or self.backlog:
            # Mid-batch, read only when the backlog cannot fill the free slots, and at
            # most every max_wait_ms: requests that arrive meanwhile join the running
            # batch together (one prefill), and a round trip per decode step would cost
            # more than the step on small models.
            now = time.monotonic()
            if len(self.backlog) < self.spec.max_batch_size - len(self.active) \
                    and now >= self._next_join_read:
                self._next_join_read = now + self.spec.max_wait_ms / 1000
                self.backlog += self._read(room, None)  # never block a running batch
            return
        # Idle: block for the first request.
        got = self._read(room, self.block_ms)
        if not got:
            return
        self._next_join_read = time.monotonic() + self.spec.max_wait_ms / 1000
        # Chat generation is continuous: a lone request starts at once, and what arrives
        # within max_wait_ms joins its batch at the next read above (vLLM's and TGI's
        # way; waiting here cost every request at low load the whole window). An
        # embedding batch is one forward pass that nothing can join later: it gathers
        # up to a full batch or until max_wait_ms after the first request.
        # The wait is ours, then one read that does not block: Redis times a blocking
        # read out on its own clock tick (up to 100 ms at its default hz), so a
        # millisecond BLOCK would cost an idle deployment ~30-100 ms per request.
        if isinstance(self.runtime, EmbeddingRuntime) and self.spec.max_wait_ms > 0 \
                and len(got) < min(self.spec.max_batch_size, room):
            time.sleep(self.spec.max_wait_ms / 1000)
            got += self._read(room - len(got), None)
        self.backlog += got

    def _reap(self) -> None:
        """Take over entries whose worker died (idle past reclaim_after_ms)."""
        claimed: list[tuple[str, str, Any]] = []
        for suffix in self._streams():
            try:
                reply = self.redis.xautoclaim(self._key(suffix), q.GROUP, self.id,
                                              min_idle_time=self.reclaim_after_ms,
                                              start_id="0-0", count=self.window)
            except redis.ResponseError as exc:
                if "NOGROUP" in str(exc):
                    continue
                raise
            claimed += [(suffix, _s(i), f) for i, f in reply[1] if f]
        if not claimed:
            return
        pipe = self.redis.pipeline(transaction=False)
        for suffix, msg_id, _ in claimed:
            pipe.xpending_range(self._key(suffix), q.GROUP, min=msg_id, max=msg_id, count=1)
        counts = pipe.execute()
        for (suffix, msg_id, fields), info in zip(claimed, counts, strict=True):
            pending = Pending(suffix, msg_id, q.QueuedRequest.from_fields(fields),
                              int(info[0]["times_delivered"]) if info else 1)
            if pending.deliveries > self.spec.max_deliveries:
                self._dead_letter(pending)
            else:
                logger.warning("took over request %s (delivery %d)", pending.req.rid,
                               pending.deliveries)
                self.backlog.append(pending)

    def _refresh_claims(self) -> None:
        """Reset the idle time of our own entries so no reaper mistakes us for dead."""
        mine = self.backlog + [a.pending for a in self.active.values()]
        for suffix, ids in _by_stream(mine).items():
            self.redis.xclaim(self._key(suffix), q.GROUP, self.id, 0, ids, justid=True)

    def _dead_letter(self, pending: Pending) -> None:
        fields = {**pending.req.fields(), "deliveries": str(pending.deliveries),
                  "worker": self.id, "at": str(q.now_ms())}
        self.redis.xadd(q.dead_key(self.spec.name), fields, maxlen=10_000, approximate=True)
        logger.error("request %s dead-lettered after %d deliveries", pending.req.rid,
                     pending.deliveries)
        self._error(pending, RequestError(
            500, "dead_lettered",
            "The request failed repeatedly on the model workers and was set aside.",
            retry=False))

    # -- admission -----------------------------------------------------------------
    def _cancellations(self) -> None:
        rids = [p.req.rid for p in self.backlog] + list(self.active)
        if not rids:
            return
        flags = self.redis.smismember(q.cancel_key(self.spec.name), rids)
        cancelled = {rid for rid, flag in zip(rids, flags, strict=True) if flag}
        if not cancelled:
            return
        for pending in [p for p in self.backlog if p.req.rid in cancelled]:
            self.backlog.remove(pending)
            self._final(pending, 0, "cancelled", prompt_tokens=0, completion_tokens=0)
        for rid in [r for r in self.active if r in cancelled]:
            self._finish(self.active[rid], "cancelled")

    def _admit(self) -> None:
        now = q.now_ms()
        for pending in [p for p in self.backlog if p.req.deadline_ms <= now]:
            self.backlog.remove(pending)
            self._error(pending, RequestError(504, "deadline_exceeded",
                                              "The request's deadline passed while it was queued."))
        if self._alone is not None:
            if self._alone in self.active:
                return  # a request on its last chance runs alone: nothing joins it
            self._alone = None
        capacity = self.spec.max_batch_size - len(self.active)
        if capacity <= 0 or not self.backlog:
            return
        # A request taken over again and again (its batches kept failing) may be what
        # fails them, a poison pill, or the unlucky neighbour of one. On its last
        # allowed delivery it runs alone: a neighbour then finishes, and a poison pill
        # fails by itself and is dead-lettered without taking the others with it.
        limit = max(2, self.spec.max_deliveries)
        last = [p for p in self.backlog if p.deliveries >= limit]
        if last:
            if self.active:
                return  # it runs alone: the running batch ends first
            chosen = last[:1]
            self._alone = chosen[0].req.rid
        else:
            chosen = pick(self.backlog, capacity, after_tenant=self._last_tenant)
        for pending in chosen:
            self.backlog.remove(pending)
        self._last_tenant = chosen[-1].tenant
        self.batches += 1
        self.admitted.append([p.req.rid for p in chosen])
        self._open_batch(chosen)
        if isinstance(self.runtime, EmbeddingRuntime):
            self._embed(chosen)
        else:
            self._start(chosen)

    # -- tracing -------------------------------------------------------------------
    def _open_batch(self, chosen: list[Pending]) -> None:
        """The batch's span, linked to the span of every request it serves (their
        traceparents travel in the queue message): one trace per request, joined here."""
        size = len(chosen)
        self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1
        links = [Link(ctx) for p in chosen
                 if (ctx := telemetry.span_context_of(p.req.traceparent)) is not None]
        span = telemetry.tracer.start_span("inference.batch", kind=SpanKind.CONSUMER,
                                           links=links, attributes={
                                               "sluice.deployment": self.spec.name,
                                               "sluice.worker": self.id,
                                               "sluice.batch.size": size,
                                               "sluice.batch.number": self.batches})
        batch = BatchSpan(span, {p.req.rid for p in chosen})
        for pending in chosen:
            self._batch_of[pending.req.rid] = batch

    def _served(self, rid: str) -> None:
        batch = self._batch_of.pop(rid, None)
        if batch is not None:
            batch.open.discard(rid)
            if not batch.open:
                batch.span.end()

    def _end_batches(self, reason: str) -> None:
        for batch in {id(b): b for b in self._batch_of.values()}.values():
            batch.span.set_attribute("sluice.batch.ended", reason)
            batch.span.end()
        self._batch_of.clear()

    def _start(self, chosen: list[Pending]) -> None:
        runtime = self.runtime
        assert isinstance(runtime, ChatRuntime)  # noqa: S101
        new: list[NewSequence] = []
        for pending in chosen:
            try:
                prepared = self._prepare(runtime, pending)
            except RequestError as exc:
                self._error(pending, exc)
                continue
            if prepared is not None:
                self.active[pending.req.rid] = prepared[0]
                new.append(prepared[1])
        if new:
            self._collect()  # sequences join between steps
        self._firsts.update(runtime.add(new))  # handled by the step that follows now

    def _prepare(self, runtime: ChatRuntime,
                 pending: Pending) -> tuple[Active, NewSequence] | None:
        """The sequence to start, or None when nothing is left to generate. A body with
        `prompt` (a legacy completion) is that text as the model's prompt, as is: no chat
        template, no history; otherwise the prompt is its `messages` after its `history`
        through the chat template (`_prompt`)."""
        try:
            job = pending.req.job()
            if not isinstance(job, ChatJob):
                raise JobError(f"a {pending.req.kind} request on a chat model")
            if job.prompt is None and not job.messages:
                raise JobError("a chat job needs messages or a prompt")
            max_tokens = job.max_tokens or default_max_tokens(runtime.max_context)
            params = SamplingParams(
                max_tokens=max_tokens, temperature=job.temperature, top_p=job.top_p,
                seed=job.seed, stop=tuple(job.stop), ignore_eos=job.ignore_eos,
                presence_penalty=job.presence_penalty,
                frequency_penalty=job.frequency_penalty,
                logit_bias=tuple(job.logit_bias.items()), logprobs=job.logprobs)
            prompt = (runtime.encode(job.prompt) if job.prompt is not None else
                      self._prompt(runtime, job.messages, job.history, max_tokens))
        except (JobError, KeyError, TypeError, ValueError) as exc:
            raise RequestError(400, "invalid_request", f"Malformed request: {exc}") from None
        if job.count_only:
            # A token count (Anthropic's count_tokens): the prompt as this runtime
            # encodes it, template and all, whatever its length; nothing generated.
            self._final(pending, 0, "stop", prompt_tokens=len(prompt), completion_tokens=0)
            return None
        if params.logit_bias and isinstance(runtime, TorchModel):
            size = int(runtime.model.config.vocab_size)
            unknown = [token for token, _ in params.logit_bias if not 0 <= token < size]
            if unknown:
                raise RequestError(400, "invalid_logit_bias",
                                   f"logit_bias names token {unknown[0]}, which is not in this "
                                   f"model's vocabulary (0 to {size - 1}).")
        room = runtime.max_context - len(prompt)
        if room <= 0:
            raise RequestError(400, "context_length_exceeded",
                               f"The prompt has {len(prompt)} tokens; this model's context is "
                               f"{runtime.max_context}.")
        active = Active(pending, prompt_tokens=len(prompt),
                        max_new=min(params.max_tokens, room), stop=params.stop,
                        ignore_eos=params.ignore_eos,
                        constraint=self._constraint(job, min(params.max_tokens, room)),
                        logprobs=params.logprobs is not None, streamed=job.stream)
        if pending.deliveries > 1 and not self._resume_state(active):
            self._acks.append(pending)  # an earlier delivery finished it
            self._served(pending.req.rid)
            return None
        constraint = active.constraint
        if constraint is not None:
            constraint.replay(active.ids)  # resumed: what was streamed was written under it
            if constraint.complete:
                self._finish(active, "tool_calls" if constraint.kind() == "calls" else "stop")
                return None
        left = active.max_new - len(active.ids)
        if left <= 0:
            self._finish(active, "length")
            return None
        params = replace(params, max_tokens=left)
        active.detok = Detokenizer(runtime.decode, active.ids)
        # A resumed request continues from what was already streamed, as context.
        return active, NewSequence(pending.req.rid, prompt + active.ids, params,
                                   generated=len(active.ids),
                                   constraint=active.constraint)

    def _constraint(self, job: ChatJob, budget: int) -> Constraint | None:
        """The grammar of a request with tools or a response format (None without);
        a runtime without a tokenizer (echo) refuses them, as does a schema that cannot
        be enforced (the gateway checked it too: this is a worker's own guard)."""
        if not job.constrained:
            return None
        tools = bool(job.tools)
        # torch- and llguidance-side code, imported when a constraint is asked for.
        from inference.constraint import Constraint, Vocabulary, plan_for

        code = "invalid_tool_schema" if tools else "invalid_response_format"
        if not isinstance(self.runtime, TorchModel):
            what = "call tools" if tools else "write structured outputs (response_format)"
            raise RequestError(400, "tools_not_supported" if tools else
                               "response_format_not_supported",
                               f"The model '{self.spec.name}' cannot {what}.")
        try:
            plan = plan_for(job)
        except ValueError as exc:
            raise RequestError(400, code, f"Invalid request: {exc}") from None
        if plan is None:
            return None
        if self._vocab is None:
            self._vocab = Vocabulary(self.runtime.tokenizer,
                                     int(self.runtime.model.config.vocab_size),
                                     sorted(self._eos))
        return Constraint(self._vocab, plan, budget=budget)

    @staticmethod
    def _prompt(runtime: ChatRuntime, messages: list[dict[str, Any]],
                history: list[dict[str, Any]], max_tokens: int) -> list[int]:
        """The prompt for a conversation: history, then this request's messages.

        Trimming policy: every message of this request stays; the oldest history
        messages are dropped, one by one, until the prompt leaves room for max_tokens
        (or for at least a quarter of the context when max_tokens asks for more)."""
        budget = runtime.max_context - min(max_tokens, runtime.max_context // 4)
        prompt = runtime.encode_chat([*history, *messages])
        while history and len(prompt) > budget:
            history = history[1:]
            prompt = runtime.encode_chat([*history, *messages])
        return prompt

    def _resume_state(self, active: Active) -> bool:
        """Load what an earlier delivery already streamed. False if it finished: then
        its final event goes to the gateway again (the worker that wrote it may have
        died before telling the gateway; a gateway that has it ignores the repeat)."""
        req = active.req
        for _id, fields in self.redis.xrange(q.out_key(req.tenant, req.rid)):
            event = json.loads(fields[b"e"])
            if event["t"] in FINAL_EVENTS:
                q.add_gateway_message(self.redis, req.gateway,
                                      [q.gateway_item(req.rid, encode_event(event))])
                return False
            if event["t"] == "delta":
                active.ids += event["ids"]
                active.sent_text += event["text"]
                active.seq = event["seq"] + 1
        active.text = active.sent_text
        return True

    # -- generation ----------------------------------------------------------------
    def _decode_step(self) -> None:
        """Hand the running batch its next tokens.

        Steps long enough to hide it (a model's forward pass, the echo runtime's delay)
        are overlapped (vLLM's asynchronous scheduling): the next step starts on the
        model thread as soon as the previous one has ended, and this thread handles the
        previous step's tokens, writes, pulls and admits meanwhile. The batch's pace is
        then the model's, not the model's plus ours (at 10,000 streams ours was 0.1 to
        0.4 s a step). The runtime is only touched between steps: a sequence that
        finishes during a step is dropped after it (it computed one token too many,
        never seen), newcomers join at the next barrier (`_collect`). Tool-call
        constraints are advanced by the sampler on the model thread, so this thread may
        see a constraint one token ahead of the token it handles; that is harmless: a
        call complete at the next token ends the sequence one token early with the
        whole call (the constraint holds it; usage counts the constraint's tokens), and
        free text decided at the next token goes out one token sooner, the same text.

        Newcomers' first tokens (their prefill's, from `_start`) are handled after the
        tokens of the step that ended as they joined: the batch's events then keep one
        order from step to step, newcomers last. Ahead of the batch, a newcomer's first
        token went out first in its wave and its second last in the next one, and its
        first gap carried a whole fan-out (at 10,000 streams, in one run, every one of
        the worst 1% of gaps)."""
        self._collect()
        tokens, self._stepped = self._stepped, None
        firsts, self._firsts = self._firsts, {}
        overlap = bool(self.active) and self._step_s >= self.overlap_min_step_s
        if overlap:
            self._stepping = self._model.submit(self._timed_step)
            self.overlapped += 1
        # One order: the step that ended, the newcomers' first tokens, and (in step)
        # this step's, which are their second.
        self._on_tokens(tokens or {})
        self._on_tokens(firsts)
        if not overlap and tokens is None and self.active:
            self._on_tokens(self._timed_step())

    def _on_tokens(self, tokens: dict[str, int]) -> None:
        for rid, token in tokens.items():
            active = self.active.get(rid)
            if active is not None:
                self._on_token(active, token)

    def _timed_step(self) -> dict[str, int]:
        runtime = self.runtime
        assert isinstance(runtime, ChatRuntime)  # noqa: S101
        started = time.perf_counter()
        tokens = runtime.step()
        self._step_s = time.perf_counter() - started
        return tokens

    def _collect(self) -> None:
        """The barrier: wait for the step running on the model thread, if any, keep its
        tokens for `_decode_step` and drop the sequences that finished while it ran. A
        model error is raised here, as an inline step would raise it."""
        if self._stepping is None:
            return
        stepping, self._stepping = self._stepping, None
        tokens = stepping.result()
        if self._dropping:
            gone = set(self._dropping)
            runtime = self.runtime
            assert isinstance(runtime, ChatRuntime)  # noqa: S101
            runtime.drop(self._dropping)
            self._dropping = []
            tokens = {rid: token for rid, token in tokens.items() if rid not in gone}
        self._stepped = tokens

    def _drop(self, rid: str) -> None:
        """Take a finished sequence out of the runtime: now, or after the running step."""
        if self._stepping is not None:
            self._dropping.append(rid)
            return
        runtime = self.runtime
        assert isinstance(runtime, ChatRuntime)  # noqa: S101
        runtime.drop([rid])

    def _on_token(self, active: Active, token: int) -> None:
        if token == FAILED:
            self._finish(active, "model_error")
            return
        constraint = active.constraint
        if token in self._eos and not active.ignore_eos:
            calls = constraint is not None and constraint.kind() == "calls"
            self._finish(active, "tool_calls" if calls else "stop")
            return
        active.ids.append(token)
        active.unsent_ids.append(token)
        if active.logprobs:
            self._logprob(active, token)
        assert active.detok is not None  # noqa: S101
        active.text += active.detok.push(token)
        if constraint is not None and constraint.complete \
                and len(active.ids) >= len(constraint.emitted):
            # The whole value (or every call) is out: the constraint may be a token ahead
            # of the tokens handled here (an overlapped step's), so it ends with its last.
            self._finish(active, "tool_calls" if constraint.kind() == "calls" else "stop")
            return
        if self._cut_at_stop(active):
            self._finish(active, "stop", flush=False)
            return
        self._emit_text(active, final=False)
        if len(active.ids) >= active.max_new:
            self._finish(active, "length")
        elif active.req.deadline_ms <= q.now_ms():
            self._finish(active, "deadline")

    def _logprob(self, active: Active, token: int) -> None:
        runtime = self.runtime
        assert isinstance(runtime, ChatRuntime)  # noqa: S101
        logprob = runtime.pop_logprob(active.req.rid)
        if logprob is None:
            return  # a runtime that has none (echo)
        if self._token_texts is None:
            from inference.logprobs import TokenTexts

            self._token_texts = TokenTexts(runtime)
        active.unsent_lps.append(self._token_texts.entry(token, logprob))

    @staticmethod
    def _cut_at_stop(active: Active) -> bool:
        """Cut the text before the first stop string in it, if any (only its new tail
        can complete one)."""
        if not active.stop:
            return False
        start = max(0, len(active.sent_text) - max(map(len, active.stop)))
        hits = [(i, s) for s in active.stop if (i := active.text.find(s, start)) >= 0]
        if hits:
            cut, active.stopped_by = min(hits)
            active.text = active.text[:cut]
        return bool(hits)

    def _emit_text(self, active: Active, *, final: bool) -> None:
        if active.constraint is not None and active.constraint.kind() != "text":
            return  # a tool call (or maybe the start of one) is not content
        text = active.text
        if not final:
            if not active.streamed:
                return
            # Hold back anything that may be the start of a stop string, so the caller
            # never sees half a stop sequence.
            for stop in active.stop:
                for n in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:n]):
                        text = text[:-n]
                        break
        delta = text[len(active.sent_text):]
        if not delta and not (final and active.unsent_ids):
            return
        event: DeltaEvent = {"t": "delta", "seq": active.seq, "text": delta,
                             "ids": active.unsent_ids}
        if active.logprobs:
            event["lp"], active.unsent_lps = active.unsent_lps, []
        self._event(active.req, event)
        active.seq += 1
        active.sent_text = text
        active.unsent_ids = []

    def _finish(self, active: Active, reason: str, *, flush: bool = True) -> None:
        if flush and active.detok is not None:
            # Text the detokenizer still held (a character split across tokens) goes
            # out, less a character the generation stopped inside.
            active.text += active.detok.flush()
            if self._cut_at_stop(active) and reason == "length":
                reason = "stop"
        self._emit_text(active, final=True)  # whatever was held back, if anything
        self._drop(active.req.rid)
        self.active.pop(active.req.rid, None)
        if reason == "tool_calls" and active.constraint is not None:
            rid = active.req.rid[:20]
            calls: list[ToolCall] = [
                {"id": f"call_{rid}" if i == 0 else f"call_{rid}_{i}", "name": name,
                 "arguments": arguments}
                for i, (name, arguments) in enumerate(active.constraint.calls())]
            # Seen one token ahead (an overlapped step), the call's last token is in
            # the constraint but not yet in ids.
            self._final(active.pending, active.seq, reason, prompt_tokens=active.prompt_tokens,
                        completion_tokens=max(len(active.ids), len(active.constraint.emitted)),
                        tool_calls=calls)
            return
        if reason == "deadline":
            self._error(active.pending, RequestError(
                504, "deadline_exceeded", "The request's deadline passed during generation."),
                seq=active.seq, cost=(active.prompt_tokens, len(active.ids)))
            return
        if reason == "model_error":
            self._error(active.pending, _not_finite(active.req.rid, "logits"),
                        seq=active.seq, cost=(active.prompt_tokens, len(active.ids)))
            return
        self._final(active.pending, active.seq, reason, prompt_tokens=active.prompt_tokens,
                    completion_tokens=len(active.ids), stop_sequence=active.stopped_by)

    def _embed(self, chosen: list[Pending]) -> None:
        runtime = self.runtime
        assert isinstance(runtime, EmbeddingRuntime)  # noqa: S101
        texts: list[str] = []
        spans: list[tuple[Pending, int, int]] = []
        for pending in chosen:
            try:
                job = pending.req.job()
                if not isinstance(job, EmbedJob):
                    raise JobError(f"a {pending.req.kind} request on an embedding model")
            except JobError as exc:
                self._error(pending, RequestError(400, "invalid_request",
                                                  f"Malformed request: {exc}"))
                continue
            inputs = job.input
            spans.append((pending, len(texts), len(texts) + len(inputs)))
            texts += inputs
        vectors: list[list[float]] = []
        counts: list[int] = []
        for start in range(0, len(texts), _EMBED_CHUNK):
            v, c = runtime.embed(texts[start:start + _EMBED_CHUNK])
            vectors += v
            counts += c
        for pending, lo, hi in spans:
            # A vector is finite iff its sum is (floats; the check is C-speed).
            if not all(math.isfinite(sum(v)) for v in vectors[lo:hi]):
                self._error(pending, _not_finite(pending.req.rid, "embeddings"))
                continue
            self._event(pending.req, {"t": "embedding", "seq": 0, "data": vectors[lo:hi]})
            self._final(pending, 1, "stop", prompt_tokens=sum(counts[lo:hi]), completion_tokens=0)

    # -- results -------------------------------------------------------------------
    def _event(self, req: q.QueuedRequest, event: Event) -> None:
        self._outbox.append((req, event))

    def _final(self, pending: Pending, seq: int, reason: str, *, prompt_tokens: int,
               completion_tokens: int, tool_calls: list[ToolCall] | None = None,
               stop_sequence: str = "") -> None:
        """`stop_sequence`: the stop string that ended the reply (Anthropic's Messages
        API names it; finish stays "stop")."""
        event: DoneEvent = {"t": "done", "seq": seq, "finish": reason,
                            "usage": usage(prompt_tokens, completion_tokens)}
        if tool_calls:
            event["tool_calls"] = tool_calls
        if stop_sequence:
            event["stop_sequence"] = stop_sequence
        self._event(pending.req, event)
        self._acks.append(pending)
        self._served(pending.req.rid)

    def _error(self, pending: Pending, exc: RequestError, *, seq: int = 0,
               cost: tuple[int, int] = (0, 0)) -> None:
        event: ErrorEvent = {"t": "error", "seq": seq, "status": exc.status,
                             "code": exc.code, "message": exc.message, "usage": usage(*cost)}
        if not exc.retry:
            event["retry"] = False
        self._event(pending.req, event)
        self._acks.append(pending)
        self._served(pending.req.rid)

    def _flush(self, *, wait: bool = False) -> None:
        """Hand this iteration's events and acks to the writer thread, so that Redis I/O
        overlaps the next decode step (torch releases the GIL while it computes). One
        write is in flight at a time: order is kept and a slow Redis slows us down.
        With no step to overlap (the batch has ended) this thread writes them itself:
        a handoff would only add a thread switch (up to the GIL's 5 ms switch interval
        while this thread runs on) to a lone request's latency."""
        if self._outbox or self._acks:
            if self._writing is not None:
                self._writing.result()
                self._writing = None
            outbox, acks = self._outbox, self._acks
            self._outbox, self._acks = [], []
            if self.active or self.backlog:
                self._writing = self._writer.submit(self._write, outbox, acks)
            else:
                self._write(outbox, acks)
        if wait and self._writing is not None:
            self._writing.result()
            self._writing = None

    def _write(self, outbox: list[tuple[q.QueuedRequest, Event]],
               acks: list[Pending]) -> None:
        encoded = [(req, event, encode_event(event)) for req, event in outbox]
        # One final event per request, ever: the first worker to set `done` owns it
        # (FINALS_LUA writes it with the request's other events of this step).
        finishing: dict[str, tuple[q.QueuedRequest, list[str]]] = {
            req.rid: (req, []) for req, event, _data in encoded
            if event["t"] in FINAL_EVENTS}
        for req, _event, data in encoded:
            if req.rid in finishing:
                finishing[req.rid][1].append(data)
        owned: set[str] = set()
        stored: dict[str, str] = {}  # rid -> the final another delivery wrote
        batch = ScriptBatch(self.redis)
        presumed: list[list[str]] = []  # request ids per FINALS call, when presumed
        if finishing:
            first = {p.req.rid for p in acks if p.deliveries == 1}
            if first.issuperset(finishing):
                # First deliveries all: no other worker can have finished them unless
                # it took one over from this worker while this one lived on (a stall
                # past reclaim_after_ms). So the claims go in the same round trip as
                # the rest, ownership presumed; in that rare case the gateway may get
                # this worker's final as well as the owner's and keeps the first (one
                # reply, once), and the request's stream keeps the owner's.
                presumed = self._claims(batch, list(finishing.values()))
                owned = set(finishing)
            else:
                # A redelivery may find its request finished: ask first, then tell
                # the gateway the final that stands.
                claims = ScriptBatch(self.redis)
                calls = self._claims(claims, list(finishing.values()))
                replies = [reply for call in claims.run() for reply in call]
                for rid, reply in zip([r for c in calls for r in c], replies, strict=True):
                    if reply == 1:
                        owned.add(rid)
                    elif reply:
                        stored[rid] = _s(reply)
        pipe = batch.pipe
        # Events first, acks after: a crash in between leaves the entry pending, and the
        # next delivery resumes from (or just acknowledges) what was written.
        by_gateway: dict[str, list[str]] = {}
        appends: dict[str, list[tuple[str, str, str]]] = {}  # tenant -> (stream, event, first)
        for req, event, data in encoded:
            if req.rid in finishing:
                if req.rid not in owned:
                    # Finished by another delivery: its events stand, and its final goes
                    # to the gateway again (which fills any gap from the request's stream
                    # and ignores a repeat); this delivery's own events are dropped.
                    if event["t"] not in FINAL_EVENTS or req.rid not in stored:
                        continue
                    data = stored[req.rid]
            else:
                appends.setdefault(req.tenant, []).append(
                    (q.out_key(req.tenant, req.rid), data, "1" if event["seq"] == 0 else "0"))
            by_gateway.setdefault(req.gateway, []).append(q.gateway_item(req.rid, data))
        for rows in appends.values():  # a tenant's streams share a cluster slot
            for chunk in chunks(rows, q.EVENTS_PER_CALL):
                batch.script(q.EVENTS_LUA, [stream for stream, _e, _f in chunk],
                             [q.OUT_TTL_S, *(x for _stream, event, first in chunk
                                             for x in (event, first))])
        # One message per gateway per iteration carries every event of the step.
        for gateway, items in by_gateway.items():
            q.add_gateway_message(pipe, gateway, items)
        for done in chunks(acks, q.EVENTS_PER_CALL):
            batch.script(q.ACKS_LUA, q.ack_keys(self.spec.name, [p.stream for p in done]),
                         [x for p in done for x in (p.req.tenant, p.stream, p.msg_id, p.req.rid)])
        replies = batch.run()
        if presumed:  # the FINALS calls went first
            for rids, call in zip(presumed, replies, strict=False):
                for rid, reply in zip(rids, call, strict=True):
                    if reply != 1:
                        logger.warning("request %s was finished by another worker too; "
                                       "the gateway kept the first final it got", rid)

    def _claims(self, batch: ScriptBatch,
                finishing: list[tuple[q.QueuedRequest, list[str]]]) -> list[list[str]]:
        """FINALS_LUA calls for the finishing requests (one per tenant and chunk) added
        to `batch`; per call, its request ids in reply order."""
        by_tenant: dict[str, list[tuple[q.QueuedRequest, list[str]]]] = {}
        for req, events in finishing:
            by_tenant.setdefault(req.tenant, []).append((req, events))
        calls: list[list[str]] = []
        for group in by_tenant.values():
            for part in chunks(group, q.EVENTS_PER_CALL):
                calls.append([req.rid for req, _events in part])
                batch.script(q.FINALS_LUA,
                             [key for req, _events in part
                              for key in (q.done_key(req.tenant, req.rid),
                                          q.out_key(req.tenant, req.rid))],
                             [self.id, q.OUT_TTL_S,
                              *(x for _req, events in part for x in (len(events), *events))])
        return calls

    def _heartbeat(self) -> None:
        guard = {_s(k): _s(v) for k, v in self.redis.hgetall(q.guard_key(self.spec.name)).items()}
        with contextlib.suppress(KeyError, ValueError):
            self.guard.configure(high=float(guard["high"]), low=float(guard["low"]),
                                 hold_s=float(guard["hold_s"]))
        used, total = self.runtime.memory()
        in_rotation = self.guard.observe(used, total, time.monotonic())
        beat = {"ts": time.time(), "pid": os.getpid(), "kind": self.spec.kind.value,
                "batch": len(self.active), "backlog": len(self.backlog),
                "load": len(self.active) + len(self.backlog),
                "max_batch": self.spec.max_batch_size, "mem_used": used, "mem_total": total,
                "batches": self.batches, "in_rotation": in_rotation}
        key = q.workers_key(self.spec.name)
        pipe = self.redis.pipeline(transaction=False)
        sizes, self.batch_sizes = self.batch_sizes, {}
        for size, count in sizes.items():  # the /metrics batch-size histogram
            pipe.hincrby(q.batch_sizes_key(self.spec.name), str(size), count)
        pipe.hset(key, self.id, json.dumps(beat))
        pipe.expire(key, 60)
        pipe.hgetall(key)
        *_, beats = pipe.execute()
        self._others_in_rotation = any(b.get("in_rotation", True) for k, b in
                                       q.live_heartbeats(beats).items() if k != self.id)


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _by_stream(pendings: list[Pending]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for pending in pendings:
        out.setdefault(pending.stream, []).append(pending.msg_id)
    return out


def heartbeats(client: redis.Redis, deployment: str, *,
               max_age_s: float = q.HEARTBEAT_MAX_AGE_S) -> dict[str, dict[str, Any]]:
    """Live workers of a deployment (heartbeat younger than max_age_s)."""
    return q.live_heartbeats(client.hgetall(q.workers_key(deployment)), max_age_s=max_age_s)


def serve(spec: DeploymentSpec, redis_url: str, **kwargs: Any) -> None:
    """Run a worker until SIGTERM/SIGINT, then drain."""
    telemetry.setup("sluice-worker")
    client = redis.Redis.from_url(redis_url, socket_timeout=30, socket_connect_timeout=5,
                                  **reconnecting())
    worker = Worker(spec, client, **kwargs)
    gctuning.tune()  # the model and the modules live as long as the process
    set_on_signals(worker.stopping)
    try:
        worker.run()
    finally:
        telemetry.shutdown()  # what the exporter still holds


def main() -> None:
    parser = argparse.ArgumentParser(description="Run one inference worker from a spec.")
    parser.add_argument("--spec", required=True, help="DeploymentSpec as JSON")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL",
                                                              "redis://127.0.0.1:6379/0"))
    parser.add_argument("--reclaim-after-ms", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("SLUICE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    serve(DeploymentSpec.from_json(args.spec), args.redis_url,
          reclaim_after_ms=args.reclaim_after_ms)


if __name__ == "__main__":
    main()
