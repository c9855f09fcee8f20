"""The worker's parts alone (inference/engine/ and the scheduler), each driven through
its public interface with real Redis and real runtimes (echo, and the tiny
random-weights model), no worker loop: the output processor turns tokens into events
(stop strings held back and cut, logprobs, finishes), the engine orders and overlaps
steps, the intake takes over a dead worker's entry and dead-letters it past
max_deliveries, the writer writes a request's final once, health beats."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inference import queue as q
from inference.engine.engine import Engine
from inference.engine.entries import Pending, RequestError
from inference.engine.health import Health
from inference.engine.inputs import InputProcessor
from inference.engine.intake import Intake
from inference.engine.output import OutputProcessor, done_event
from inference.engine.scheduler import admit, expired
from inference.engine.writer import Outbox, Writer
from inference.jobs import ChatJob, DeltaEvent, Event
from inference.runtimes import load_runtime
from inference.runtimes.base import ChatRuntime, NewSequence, SamplingParams
from inference.runtimes.echo import EOS, EchoRuntime
from inference.spec import DeploymentSpec, RuntimeName
from inference.worker import heartbeats
from tests.conftest import eventually
from tests.inference.conftest import chat, unique

pytestmark = pytest.mark.cluster


def echo_spec(**kw: Any) -> DeploymentSpec:
    return DeploymentSpec(unique("echo"), RuntimeName.ECHO, **kw)


def request(job: ChatJob, *, tenant: str = "t", gateway: str = "gw") -> q.QueuedRequest:
    return q.QueuedRequest.of(job, rid=unique("r"), tenant=tenant, gateway=gateway,
                              deadline_ms=q.now_ms() + 60_000)


def enqueue(rds: redis.Redis, spec: DeploymentSpec, req: q.QueuedRequest) -> None:
    """As the gateway enqueues (ENQUEUE_LUA: the stream, its group, the counters)."""
    suffix = q.stream_suffix(req.tenant, req.priority)
    fields = [x for kv in req.fields().items() for x in kv]
    reply = rds.eval(q.ENQUEUE_LUA, 4, *q.queue_keys(spec.name, suffix), 100, 100,
                     req.tenant, suffix, *fields)
    assert reply[0] == 1


def intake(spec: DeploymentSpec, rds: redis.Redis, name: str, *,
           reclaim_after_ms: int = 30_000) -> Intake:
    return Intake(spec, rds, name, reclaim_after_ms=reclaim_after_ms,
                  stopping=threading.Event())


class Harness:
    """An output processor over a runtime, its outbox, and the requests it serves."""

    def __init__(self, runtime: ChatRuntime) -> None:
        self.runtime = runtime
        self.served: list[str] = []
        self.outbox = Outbox(served=self.served.append)
        self.output = OutputProcessor(self.outbox, runtime)
        self.inputs = InputProcessor(runtime, model_name="m")

    def start(self, job: ChatJob) -> NewSequence:
        prepared = self.inputs.prepare(Pending("t:0", "1-1", request(job)))
        seq = self.output.start(prepared.row, prepared.prompt, prepared.params)
        assert seq is not None
        return seq

    def events(self, rid: str) -> list[Event]:
        return [event for req, event in self.outbox.events if req.rid == rid]


# -- output processor -----------------------------------------------------------------


def test_text_that_may_start_a_stop_string_is_held_back_then_released_or_cut() -> None:
    """Given two rows with the stop string "XY": an "X" is held back until the next
    token tells; "Xb" goes out together, and "XY" ends the reply before it, the stop
    string named and every token counted."""
    h = Harness(EchoRuntime())
    stopped = h.start(chat("abXYcd", stop=["XY"])).rid
    released = h.start(chat("aXb", stop=["XY"])).rid
    steps = [(b"a", b"a"), (b"b", b"X"), (b"X", b"b"), (b"Y", None)]
    ended = [h.output.handle({stopped: a[0], released: b[0] if b else EOS})
             for a, b in steps]
    assert ended == [[], [], [], [stopped, released]]
    assert h.events(stopped) == [
        {"t": "delta", "seq": 0, "text": "a", "ids": [97], "prompt_tokens": 6},
        {"t": "delta", "seq": 1, "text": "b", "ids": [98]},
        {"t": "delta", "seq": 2, "text": "", "ids": [88, 89]},  # "XY" is cut, not sent
        done_event(3, "stop", prompt_tokens=6, completion_tokens=4, stop_sequence="XY")]
    assert h.events(released) == [
        {"t": "delta", "seq": 0, "text": "a", "ids": [97], "prompt_tokens": 3},
        {"t": "delta", "seq": 1, "text": "Xb", "ids": [88, 98]},
        done_event(2, "stop", prompt_tokens=3, completion_tokens=3)]
    assert h.served == [stopped, released] and not h.output.rows
    assert [p.req.rid for p in h.outbox.acks] == [stopped, released]
    assert h.output.handle({stopped: 97}) == [], "an ended row takes no more tokens"


def test_a_reply_nobody_streams_goes_out_whole_and_a_model_fault_is_a_final_500() -> None:
    h = Harness(EchoRuntime())
    whole = h.start(chat("hello", stream=False, max_tokens=3)).rid
    faulty = h.start(chat("hello")).rid
    for token in b"hel":
        h.output.handle({whole: token, faulty: token} if token != ord("l")
                        else {whole: token, faulty: -1})
    assert h.events(whole) == [
        {"t": "delta", "seq": 0, "text": "hel", "ids": [104, 101, 108], "prompt_tokens": 5},
        done_event(1, "length", prompt_tokens=5, completion_tokens=3)]
    *deltas, final = h.events(faulty)
    assert "".join(e["text"] for e in deltas if e["t"] == "delta") == "he"
    assert final["t"] == "error" and final["status"] == 500 and final["code"] == "model_error"
    assert final.get("retry") is False and final["usage"]["completion_tokens"] == 2


def test_a_resumed_row_continues_after_what_was_streamed() -> None:
    """A takeover's row holds the earlier delivery's tokens: the sequence's context is
    the prompt and those tokens, its budget what is left, its events carry on the
    sequence numbers."""
    h = Harness(EchoRuntime())
    prepared = h.inputs.prepare(Pending("t:0", "1-1", request(chat("hello", max_tokens=4)),
                                        deliveries=2))
    earlier: list[DeltaEvent] = [{"t": "delta", "seq": 0, "text": "h", "ids": [104]},
                                 {"t": "delta", "seq": 1, "text": "e", "ids": [101]}]
    prepared.row.resume(earlier)
    seq = h.output.start(prepared.row, prepared.prompt, prepared.params)
    assert seq is not None
    assert seq.prompt_ids == [*b"hello", 104, 101] and seq.generated == 2
    assert seq.params.max_tokens == 2
    rid = seq.rid
    for token in b"ll":
        h.output.handle({rid: token})
    assert h.events(rid) == [{"t": "delta", "seq": 2, "text": "l", "ids": [108]},
                             {"t": "delta", "seq": 3, "text": "l", "ids": [108]},
                             done_event(4, "length", prompt_tokens=5, completion_tokens=4)]


def test_logprobs_go_out_with_their_tokens() -> None:
    """The tiny model, greedy, with two alternatives per token: every delta carries one
    entry per token id, each the chosen token's (the best of its alternatives) with its
    text and bytes; the deltas' text is the tokens' text."""
    runtime = load_runtime(DeploymentSpec(unique("tiny"), RuntimeName.TINY_CAUSAL_LM))
    assert isinstance(runtime, ChatRuntime)
    h = Harness(runtime)
    engine = Engine(runtime, overlap_min_step_s=1e9)
    seq = h.start(chat("tell me about the sea", max_tokens=6, logprobs=2, ignore_eos=True))
    engine.add([seq])
    while h.output.rows:
        for tokens in engine.step():
            engine.drop(h.output.handle(tokens))
    engine.close(wait=True)
    *deltas, final = h.events(seq.rid)
    assert final["t"] == "done" and final["usage"]["completion_tokens"] == 6
    ids = [i for e in deltas if e["t"] == "delta" for i in e["ids"]]
    entries = [x for e in deltas if e["t"] == "delta" for x in e["lp"]]
    assert len(ids) == len(entries) == 6 and not runtime.active
    for entry in entries:
        assert len(entry["top_logprobs"]) == 2
        best, second = entry["top_logprobs"]
        assert entry["logprob"] == pytest.approx(best["logprob"])  # greedy: the best
        assert entry["logprob"] <= 0
        assert entry["token"] == best["token"] and second["logprob"] <= best["logprob"]
        assert bytes(entry["bytes"]).decode("utf-8", "backslashreplace") == entry["token"]
    text = "".join(e["text"] for e in deltas if e["t"] == "delta")
    assert text == runtime.decode(ids).rstrip("\ufffd")


def test_the_input_processor_refuses_what_cannot_run_and_counts_a_prompt() -> None:
    inputs = InputProcessor(EchoRuntime(max_context=8), model_name="echo")

    def refused(job: ChatJob) -> RequestError:
        with pytest.raises(RequestError) as caught:
            inputs.prepare(Pending("t:0", "1-1", request(job)))
        return caught.value

    assert refused(chat("y" * 20)).code == "context_length_exceeded"
    assert refused(ChatJob()).code == "invalid_request"
    tools = [{"name": "f", "parameters": {"type": "object"}}]
    assert refused(chat("hi", tools=tools, tool_choice="required")).code == \
        "tools_not_supported"
    # offered tools under "auto", it answers in text
    assert inputs.prepare(Pending("t:0", "1-1", request(chat("hi", tools=tools)))).row
    counted = inputs.prepare(Pending("t:0", "1-1", request(chat("y" * 20, count_only=True))))
    assert counted.count_only and counted.row.prompt_tokens == 20


# -- engine ---------------------------------------------------------------------------


def test_what_the_kv_cache_cannot_hold_is_refused_and_answered_400_or_503() -> None:
    """The tiny model with a cache of two short rows: two start; a third would fit once
    they leave (a retriable 503); one longer than the whole cache never fits (a 400).
    The refused ones change nothing in the runtime."""
    probe = load_runtime(DeploymentSpec(unique("tiny"), RuntimeName.TINY_CAUSAL_LM))
    assert isinstance(probe, ChatRuntime)
    prompt = len(probe.encode_chat([{"role": "user", "content": "hi"}]))
    capacity = 2 * (prompt + 8)
    runtime = load_runtime(DeploymentSpec(unique("tiny"), RuntimeName.TINY_CAUSAL_LM,
                                          extra={"kv_cache_tokens": capacity}))
    assert isinstance(runtime, ChatRuntime) and runtime.kv_capacity_tokens == capacity
    h = Harness(runtime)
    engine = Engine(runtime)
    a, b, c = (h.start(chat("hi", max_tokens=8)) for _ in range(3))
    huge = h.start(chat("hi", max_tokens=capacity))
    refused = engine.add([a, b, c, huge])
    assert [(seq.rid, r.status, r.retriable) for seq, r in refused] == [
        (c.rid, 503, True), (huge.rid, 400, False)]
    assert sorted(runtime.active) == sorted([a.rid, b.rid]) == sorted(engine.rows)
    for seq, refusal in refused:  # as the worker answers them
        h.output.fail(seq.rid, RequestError(refusal.status, refusal.code, refusal.message,
                                            retry=refusal.retriable))
    [full] = h.events(c.rid)
    [small] = h.events(huge.rid)
    assert full["t"] == "error" and full["code"] == "kv_cache_full" and "retry" not in full
    assert small["t"] == "error" and small["code"] == "kv_cache_too_small"
    assert small["status"] == 400 and small.get("retry") is False
    assert set(h.output.rows) == {a.rid, b.rid}
    engine.close(wait=True)


def sequence(rid: str, text: bytes) -> NewSequence:
    return NewSequence(rid, list(text), SamplingParams(max_tokens=100))


def test_overlapped_steps_hand_out_tokens_in_order_and_drop_after_the_running_step() -> None:
    """Every step overlaps (no minimum step time): the tokens of the step that ended
    come out first, then a newcomer's first token; a row dropped while a step runs
    leaves the runtime after it, its token of that step never handed out."""
    runtime = EchoRuntime(token_delay_ms=5)
    engine = Engine(runtime, overlap_min_step_s=0.0)
    try:
        engine.add([sequence("a", b"abcdef")])
        assert list(engine.step()) == [{}, {"a": ord("a")}]
        engine.add([sequence("b", b"xyz")])  # joins at the barrier
        assert list(engine.step()) == [{"a": ord("b")}, {"b": ord("x")}]
        engine.drop(["a"])  # its step is running
        assert "a" in runtime.active
        assert list(engine.step()) == [{"b": ord("y")}, {}]
        assert runtime.active == ["b"] and engine.rows == {"b"}
        assert engine.overlapped == 3
        engine.settle()
        assert list(engine.step()) == [{}, {}], "a settled step's tokens are nobody's"
    finally:
        engine.close(wait=True)


def test_an_inline_step_runs_after_the_handed_out_tokens_are_handled() -> None:
    """Steps shorter than the minimum run inline, after the caller has handled the
    tokens before them: a row the caller ends on its first token is not stepped."""
    runtime = EchoRuntime()
    engine = Engine(runtime, overlap_min_step_s=1e9)
    engine.add([sequence("a", b"a"), sequence("b", b"bcd")])
    got = []
    for tokens in engine.step():
        got.append(tokens)
        if "a" in tokens:
            engine.drop(["a"])  # what the output processor's end of a row leads to
    assert got == [{}, {"a": ord("a"), "b": ord("b")}, {"b": ord("c")}]
    assert runtime.active == ["b"] and engine.overlapped == 0
    engine.close(wait=True)


def test_no_step_runs_ahead_of_rows_that_made_their_last_token() -> None:
    """Overlapped, a batch whose every row has made its max_tokens starts no step ahead
    (its tokens would be nobody's and the next prefill would wait for it)."""
    from inference.runtimes.causal_lm import CausalLMRuntime, tiny_llama

    model, tokenizer = tiny_llama(max_context=64)
    runtime = CausalLMRuntime(model, tokenizer, device="cpu", max_context=64)
    engine = Engine(runtime, overlap_min_step_s=0.0)
    try:
        engine.add([NewSequence("a", [300, 301, 302], SamplingParams(max_tokens=2)),
                    NewSequence("b", [303, 304], SamplingParams(max_tokens=3))])
        made: dict[str, int] = {"a": 0, "b": 0}
        for _ in range(4):
            for tokens in engine.step():
                for rid in tokens:
                    made[rid] += 1
                ended = [rid for rid in tokens if made[rid] == {"a": 2, "b": 3}[rid]]
                engine.drop(ended)
        assert made == {"a": 2, "b": 3}
        assert engine.overlapped == 2  # the steps of tokens 2 and 3, none beyond
        assert not runtime.exhausted() and not runtime.active
        # A row whose first token is the end of its sequence gets no step either.
        eos = next(iter(runtime.eos_token_ids))
        engine.add([NewSequence("c", [305, 306], SamplingParams(
            max_tokens=50, logit_bias=((eos, 100.0),)))])
        assert runtime.exhausted()
        got = []
        for tokens in engine.step():
            got.append(tokens)
            engine.drop(list(tokens))  # the output processor ends it on that token
        assert got == [{}, {"c": eos}] and engine.overlapped == 2
    finally:
        engine.close(wait=True)


def test_each_sequence_is_given_its_share_of_the_step_time() -> None:
    """Device time: a step's time split evenly among the sequences it advanced, a
    prefill's by prompt length; what a finished sequence reports is taken once; a
    sequence that ended during an overlapped step gets none of it. The shares add up
    to the steps' time."""
    runtime = EchoRuntime(token_delay_ms=20)
    engine = Engine(runtime, overlap_min_step_s=0.0)
    began = time.perf_counter()
    try:
        engine.add([sequence("a", b"a" * 30), sequence("b", b"b" * 10)])
        for _ in range(3):
            list(engine.step())
        engine.drop(["b"])  # its step is running: its token of it is nobody's
        b = engine.take_device_s("b")
        list(engine.step())
        engine.settle()
        a = engine.take_device_s("a")
    finally:
        engine.close(wait=True)
    assert engine.take_device_s("a") == 0.0, "taken once"
    assert 0.02 <= b < a < time.perf_counter() - began
    # a: half of each of the three steps it shared (b's half of the third is nobody's)
    # and the whole of the one it ran alone, each at least the echo's 20 ms.
    assert a >= 3 * 0.02 / 2 + 0.02


# -- intake ---------------------------------------------------------------------------


def test_the_intake_takes_over_a_dead_workers_entry_and_dead_letters_it_past_max_deliveries(
        rds: redis.Redis) -> None:
    spec = echo_spec(max_deliveries=2)
    req = request(chat("hi"))
    enqueue(rds, spec, req)
    dead = intake(spec, rds, "dead")
    dead.pull(running=0, block_ms=100)
    [first] = dead.backlog
    assert (first.req.rid, first.deliveries) == (req.rid, 1)
    # Idle past reclaim_after_ms: its worker is dead, a live one takes it over.
    second = intake(spec, rds, "second", reclaim_after_ms=50)
    taken = eventually(lambda: second.reap() or second.backlog, what="the takeover")
    assert [(p.msg_id, p.deliveries) for p in taken] == [(first.msg_id, 2)]
    # Handed back by a worker that stops: the next reaper takes it at once, its count
    # set back by the delivery that did not run to its end.
    second.release(second.backlog)
    third = intake(spec, rds, "third")
    assert third.reap() == [] and [p.deliveries for p in third.backlog] == [2]
    # Handed back from a batch that failed: it counts; past max_deliveries it is
    # dead-lettered, and the caller answers it.
    third.release(third.backlog, failed=True)
    fourth = intake(spec, rds, "fourth")
    [lettered] = fourth.reap()
    assert lettered.req.rid == req.rid and lettered.deliveries == 3 and not fourth.backlog
    [(_id, fields)] = rds.xrange(q.dead_key(spec.name))
    assert fields[b"rid"].decode() == req.rid and fields[b"deliveries"] == b"3"
    assert fields[b"worker"] == b"fourth"


def test_the_intake_reads_every_tenant_and_finds_cancelled_requests(rds: redis.Redis) -> None:
    spec = echo_spec(max_batch_size=4)
    reqs = [request(chat(f"m{i}"), tenant=f"t{i % 2}") for i in range(4)]
    for req in reqs:
        enqueue(rds, spec, req)
    reader = intake(spec, rds, "w")
    reader.pull(running=0, block_ms=100)
    assert {p.req.rid for p in reader.backlog} == {r.rid for r in reqs}
    assert {p.stream for p in reader.backlog} == {"t0:0", "t1:0"}
    rds.sadd(q.cancel_key(spec.name), reqs[0].rid, "running-1")
    now = time.monotonic()
    cancelled = reader.cancellations(now, ["running-1", "running-2"])
    assert cancelled is not None
    assert [p.req.rid for p in cancelled.waiting] == [reqs[0].rid]
    assert cancelled.running == ["running-1"]
    assert reqs[0].rid not in {p.req.rid for p in reader.backlog}
    assert reader.cancellations(now, ["running-1"]) is None, "looked up once per interval"


# -- writer ---------------------------------------------------------------------------


def test_the_writer_writes_a_requests_final_once_and_acknowledges_its_entry(
        rds: redis.Redis) -> None:
    """The first delivery to finish a request writes its events and owns its final;
    another delivery's final (a takeover that finished it too) appends nothing, and the
    gateway is told the final that stands."""
    spec, gateway = echo_spec(), unique("gw")
    req = request(chat("hi"), gateway=gateway)
    enqueue(rds, spec, req)
    reader = intake(spec, rds, "w1")
    reader.pull(running=0, block_ms=100)
    [pending] = reader.backlog
    served: list[str] = []
    outbox = Outbox(served=served.append)
    outbox.add(req, {"t": "delta", "seq": 0, "text": "hi", "ids": [104, 105]})
    outbox.final(pending, done_event(1, "stop", prompt_tokens=2, completion_tokens=2))
    writer = Writer(rds, spec.name, "w1")
    writer.flush(outbox, background=True, wait=True)
    assert not outbox and served == [req.rid]

    def stream() -> list[bytes]:
        return [f[b"e"] for _id, f in rds.xrange(q.out_key(req.tenant, req.rid))]

    owned = stream()
    assert [e.startswith(t) for e, t in zip(owned, (b'{"t":"delta"', b'{"t":"done"'),
                                           strict=True)] == [True, True]
    assert rds.get(q.done_key(req.tenant, req.rid)) == b"w1"
    assert rds.xpending(q.stream_key(spec.name, pending.stream), q.GROUP)["pending"] == 0
    assert int(rds.get(q.depth_key(spec.name))) == 0
    # A redelivery finishes it again, differently.
    other = Writer(rds, spec.name, "w2")
    other.write([(req, {"t": "delta", "seq": 0, "text": "no", "ids": [110, 111]}),
                 (req, done_event(1, "length", prompt_tokens=2, completion_tokens=9))],
                [Pending(pending.stream, pending.msg_id, req, deliveries=2)])
    assert stream() == owned, "one final, the first's"
    assert int(rds.get(q.depth_key(spec.name))) == 0, "acknowledged once"
    messages = [f[b"b"] for _id, f in rds.xrange(q.gateway_key(gateway))]
    assert len(messages) == 2 and owned[1] in messages[1] and b"no" not in messages[1]
    writer.close(wait=True)
    other.close(wait=True)


def test_what_a_delivery_streamed_is_what_a_takeover_reads(rds: redis.Redis) -> None:
    spec = echo_spec()
    req = request(chat("hello"))
    writer, reader = Writer(rds, spec.name, "w"), intake(spec, rds, "r")
    deltas: list[DeltaEvent] = [{"t": "delta", "seq": 0, "text": "he", "ids": [104, 101]},
                                {"t": "delta", "seq": 1, "text": "l", "ids": [108]}]
    writer.write([(req, e) for e in deltas], [])
    assert reader.streamed(req).deltas == deltas and reader.streamed(req).final is None
    done = done_event(2, "stop", prompt_tokens=5, completion_tokens=3)
    writer.write([(req, done)], [])
    assert reader.streamed(req).final == done
    writer.close(wait=True)


# -- scheduler ------------------------------------------------------------------------


@dataclass(frozen=True)
class Waiting:
    name: str
    tenant: str = "a"
    priority: int = 0
    deliveries: int = 1
    deadline_ms: int = 10**12


def test_a_request_on_its_last_delivery_runs_alone() -> None:
    fresh, last = Waiting("fresh"), Waiting("last", tenant="b", deliveries=3)
    waiting = [fresh, last]
    common: dict[str, Any] = {"max_batch_size": 8, "max_deliveries": 3}
    assert admit(waiting, running=0, **common) == ([last], True)
    assert admit(waiting, running=2, **common) == ([], False), "the batch ends first"
    assert admit([fresh], running=0, alone_running=True, **common) == ([], False)
    assert admit([fresh, Waiting("x", "b")], running=7, **common) == ([fresh], False)
    assert admit([fresh], running=8, **common) == ([], False)
    assert expired([fresh, Waiting("late", deadline_ms=5)], now_ms=5) == [Waiting(
        "late", deadline_ms=5)]


# -- health ---------------------------------------------------------------------------


class _Sized(EchoRuntime):
    """A runtime whose KV cache has a size (in tokens)."""

    kv_capacity_tokens = 4096

    def kv_used_tokens(self) -> int:
        return 96


def test_a_heartbeat_reports_the_workers_load_and_batches_and_spans_end_when_served(
        rds: redis.Redis, spans: InMemorySpanExporter) -> None:
    spec = echo_spec(max_batch_size=8)
    health = Health(spec, rds, "w", _Sized(), heartbeat_s=60)
    batch = [Pending("t:0", f"{i}-1", request(chat("x"))) for i in range(3)]
    health.open_batch(batch[:2])
    health.open_batch(batch[2:])
    health.beat(time.monotonic(), batch=3, backlog=2)
    beat = heartbeats(rds, spec.name)["w"]
    assert {k: beat[k] for k in ("batch", "backlog", "load", "max_batch", "batches",
                                 "in_rotation", "kv_capacity_tokens", "kv_used_tokens")} == {
        "batch": 3, "backlog": 2, "load": 5, "max_batch": 8, "batches": 2,
        "in_rotation": True, "kv_capacity_tokens": 4096, "kv_used_tokens": 96}
    assert 0 < beat["mem_used"] <= beat["mem_total"]
    assert rds.hgetall(q.batch_sizes_key(spec.name)) == {b"2": b"1", b"1": b"1"}
    health.served(batch[0].req.rid)
    assert not [s for s in spans.get_finished_spans() if s.name == "inference.batch"]
    health.served(batch[1].req.rid)
    [ended] = [s for s in spans.get_finished_spans() if s.name == "inference.batch"]
    assert ended.attributes and ended.attributes["sluice.batch.size"] == 2
    health.end_batches("released")
    assert len([s for s in spans.get_finished_spans() if s.name == "inference.batch"]) == 2
    health.leave()
    assert "w" not in heartbeats(rds, spec.name)
    # A runtime that sets no bound (echo; the CPU's dynamic cache) reports none.
    Health(spec, rds, "u", EchoRuntime(), heartbeat_s=60).beat(0.0, batch=0, backlog=0)
    assert "kv_capacity_tokens" not in heartbeats(rds, spec.name)["u"]
