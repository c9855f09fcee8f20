"""Fair share of a deployment's running slots: a tenant whose long streams hold every
slot gives way (recompute preemption) to another tenant that arrives, the paused
replies continuing token-identical; and an over-long prompt is refused without being
encoded whole. The pure policy is tested alone in test_scheduler.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from inference.client import InferenceClient
from inference.engine.engine import Engine
from inference.engine.entries import Pending, RequestError
from inference.engine.inputs import InputProcessor
from inference.jobs import ChatJob
from inference.runtimes import load_runtime
from inference.runtimes.base import ChatRuntime
from inference.runtimes.echo import EchoRuntime
from inference.spec import DeploymentSpec, RuntimeName
from inference.worker import Worker
from tests.conftest import eventually
from tests.inference.conftest import chat, collect, run, unique
from tests.inference.test_engine_parts import Harness, request

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def tiny() -> ChatRuntime:
    """The toy model, built once for this module (a build takes seconds)."""
    runtime = load_runtime(DeploymentSpec(unique("tiny"), RuntimeName.TINY_CAUSAL_LM,
                                          max_context=256))
    assert isinstance(runtime, ChatRuntime)
    return runtime


def _ids(h: Harness, rid: str) -> list[int]:
    return [i for e in h.events(rid) if e["t"] == "delta" for i in e["ids"]]


def _generate(runtime: ChatRuntime, jobs: list[ChatJob], *, pause: int | None
              ) -> list[list[int]]:
    """Run `jobs` together to their end, every step overlapped; with `pause`, the first
    is preempted after that many steps and resumed three steps later."""
    h = Harness(runtime)
    engine = Engine(runtime, overlap_min_step_s=0.0)
    seqs = [h.start(job) for job in jobs]
    rids = [seq.rid for seq in seqs]
    engine.add(seqs)
    steps, parked_at = 0, None
    try:
        while h.output.rows or h.output.parked:
            for tokens in engine.step():
                engine.drop(h.output.handle(tokens))
            steps += 1
            if steps == pause and rids[0] in h.output.rows:
                for tokens in engine.pause([rids[0]]):
                    h.output.handle(tokens)
                engine.drop([rids[0]])
                h.output.park(rids[0])
                parked_at = steps
            if parked_at is not None and steps == parked_at + 3:
                engine.add([h.output.unpark(rids[0])])
        engine.settle()
    finally:
        engine.close(wait=True)
    if pause is not None:
        assert parked_at is not None, "the first sequence was preempted"
    for rid in rids:
        seqs_sent = [e["seq"] for e in h.events(rid)]
        assert seqs_sent == list(range(len(seqs_sent))), "no event lost or repeated"
    return [_ids(h, rid) for rid in rids]


def test_a_preempted_sequence_continues_token_identical_under_greedy_decoding(
        tiny: ChatRuntime) -> None:
    runtime = tiny
    jobs = [chat("tell me a story about a dragon", max_tokens=12, ignore_eos=True),
            chat("what is two plus two?", max_tokens=12, ignore_eos=True)]
    plain = _generate(runtime, jobs, pause=None)
    assert len(plain[0]) == 12
    assert _generate(runtime, jobs, pause=5) == plain


# -- the worker -----------------------------------------------------------------------


def test_a_tenant_holding_every_slot_gives_way_to_another_that_arrives(
        rds: redis.Redis, redis_url: str, thread_worker: Any) -> None:
    """Tenant a's long streams fill every slot; tenant b's one request gets its first
    token before any of a's ends, and a's replies, paused and resumed, are whole."""
    spec = DeploymentSpec(unique("fair"), RuntimeName.ECHO, max_batch_size=4,
                          echo_token_delay_ms=10, max_queue_depth=64,
                          tenant_running_share=0.5)
    worker: Worker = thread_worker(spec)
    texts = [f"{i}" + "abcdefghij" * 25 for i in range(4)]  # 251 tokens: 2.5 s each
    seen: list[str] = []  # "a-done", "b-first", in the order they came

    async def go(client: InferenceClient) -> tuple[list[Any], Any]:
        handles = [await client.submit(spec, tenant="a", job=chat(t), timeout_s=60)
                   for t in texts]

        async def watch_a(handle: Any) -> Any:
            result = await collect(handle)
            seen.append("a-done")
            return result

        a_tasks = [asyncio.create_task(watch_a(h)) for h in handles]
        await asyncio.to_thread(eventually, lambda: len(worker.active) == 4, 10,
                                what="a's four streams running")
        b = await client.submit(spec, tenant="b", job=chat("hello b"), timeout_s=60)
        events: list[Any] = []
        async for event in b.events():
            if not events:
                seen.append("b-first")
            events.append(event)
        return list(await asyncio.gather(*a_tasks)), events

    a_results, b_events = run(go, redis_url)
    assert seen.index("b-first") < seen.index("a-done"), seen
    assert "".join(e.get("text", "") for e in b_events) == "hello b"
    assert worker.preempted >= 1
    for text, result in zip(texts, a_results, strict=True):
        assert result.text == text, "a paused reply is whole, nothing lost or repeated"
        assert [e["seq"] for e in result.events] == list(range(len(result.events)))
        assert result.final["usage"]["completion_tokens"] == len(text)


# -- over-long prompts ----------------------------------------------------------------


class CountingEcho(EchoRuntime):
    """The echo runtime, keeping the length of every text it encodes."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.encoded: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.encoded.append(len(text))
        return super().encode(text)


def _refusal(inputs: InputProcessor, job: ChatJob) -> RequestError:
    try:
        inputs.prepare(Pending("t:0", "1-1", request(job)))
    except RequestError as exc:
        return exc
    raise AssertionError("the prompt was not refused")


def test_a_prompt_of_megabytes_is_refused_without_encoding_it_whole() -> None:
    runtime = CountingEcho(max_context=1024)
    inputs = InputProcessor(runtime, model_name="m")
    huge = "é" + "x" * (4 * 1024 * 1024)
    for job in (ChatJob(prompt=huge), chat(huge)):
        runtime.encoded.clear()
        refusal = _refusal(inputs, job)
        assert (refusal.status, refusal.code) == (400, "context_length_exceeded")
        assert "more than 1024 tokens" in refusal.message
        assert runtime.encoded and max(runtime.encoded) <= 1025, runtime.encoded
    # A prompt just over the context is counted exactly, as before.
    refusal = _refusal(inputs, ChatJob(prompt="y" * 1025))
    assert refusal.code == "context_length_exceeded" and "1025 tokens" in refusal.message


def test_a_real_tokenizers_cut_prompt_is_still_refused(tiny: ChatRuntime) -> None:
    runtime = tiny
    chars = runtime.token_chars()
    assert chars is not None
    inputs = InputProcessor(runtime, model_name="m")
    refusal = _refusal(inputs, chat("the cat sat on the mat. " * 200_000))  # 4.8 MB
    assert refusal.code == "context_length_exceeded"
