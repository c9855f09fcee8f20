"""Runtimes: continuous batching gives the same tokens as running alone; sampling is
seeded; the echo runtime echoes; the real models answer sensibly.

The torch runtimes' tests run on the CPU and, where a CUDA device is present, again on it
(skipped elsewhere: CI has no GPU). On a GPU machine they run alone, without the suite's
conftest (Django, PostgreSQL): `tests/bench/gpu_check.sh` says how."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.runtimes import load_runtime
from inference.runtimes.base import FAILED, ChatRuntime, NewSequence, SamplingParams
from inference.runtimes.causal_lm import CausalLMRuntime
from inference.runtimes.encoder import EncoderRuntime
from inference.runtimes.static_lm import StaticCausalLMRuntime
from inference.spec import DeploymentSpec, RuntimeName
from inference.weights import MINILM, SMOLLM2

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine"))]


@pytest.fixture(scope="module", params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module", params=["dynamic", "static"])
def tiny(device: str, request: pytest.FixtureRequest) -> CausalLMRuntime:
    """The toy model on each device, decoding over a DynamicCache (the default) and
    over static slots (StaticCausalLMRuntime, test_static_cache.py)."""
    runtime = load_runtime(DeploymentSpec("tiny", RuntimeName.TINY_CAUSAL_LM, device=device,
                                          extra={"decode": request.param}))
    assert isinstance(runtime, CausalLMRuntime)
    assert isinstance(runtime, StaticCausalLMRuntime) == (request.param == "static")
    return runtime


def alone(rt: ChatRuntime, prompt: list[int], n: int, params: SamplingParams | None = None
          ) -> list[int]:
    p = params or SamplingParams(max_tokens=n)
    tokens = [rt.add([NewSequence("solo", prompt, p)])["solo"]]
    while len(tokens) < n:
        tokens.append(rt.step()["solo"])
    rt.drop(["solo"])
    return tokens


def prompts(rt: ChatRuntime) -> list[list[int]]:
    texts = ["hi", "tell me a story about a dragon and a knight in a castle far away",
             "what is two plus two?", "x " * 40]
    return [rt.encode_chat([{"role": "user", "content": t}]) for t in texts]


def test_continuous_batching_matches_running_alone(tiny: CausalLMRuntime) -> None:
    ps = prompts(tiny)
    n = 10
    expected = [alone(tiny, p, n) for p in ps]
    assert len({tuple(e) for e in expected}) == len(ps), "toy model must not be constant"
    got: dict[str, list[int]] = {}
    # Sequences join at different steps and leave when done: 0 and 1 start together,
    # 2 joins after 3 steps, 3 after 6; each stops after n tokens.
    joins = {0: [0, 1], 3: [2], 6: [3]}
    step = 0
    while len(got) < len(ps) or any(len(v) < n for v in got.values()):
        new = [NewSequence(str(i), ps[i], SamplingParams(max_tokens=n))
               for i in joins.get(step, [])]
        for rid, tok in tiny.add(new).items():
            got[rid] = [tok]
        for rid, tok in tiny.step().items():
            got[rid].append(tok)
        tiny.drop([rid for rid, toks in got.items() if len(toks) >= n and rid in tiny.active])
        step += 1
    assert [got[str(i)][:n] for i in range(len(ps))] == expected
    assert tiny.active == []


def test_cache_shrinks_when_long_sequence_leaves(tiny: CausalLMRuntime) -> None:
    if isinstance(tiny, StaticCausalLMRuntime):
        pytest.skip("a DynamicCache's trimming; static slots do not shrink")
    short, long = tiny.encode("a"), tiny.encode("word " * 100)
    tiny.add([NewSequence("s", short), NewSequence("l", long)])
    tiny.step()
    width_before = tiny._mask.shape[1]
    tiny.drop(["l"])
    assert tiny._mask.shape[1] < width_before / 10
    assert alone(tiny, short, 3)  # still usable
    tiny.drop(["s"])


def test_seeded_sampling_is_reproducible(tiny: CausalLMRuntime) -> None:
    p = prompts(tiny)[1]
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234)
    assert alone(tiny, p, 8, params) == alone(tiny, p, 8, params)
    other = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=99)
    assert alone(tiny, p, 8, params) != alone(tiny, p, 8, other)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=12))
def test_decode_is_the_tokenizers(tiny: CausalLMRuntime, ids: list[int]) -> None:
    # The runtime calls the Rust tokenizer directly (no wrapper): the same text, special
    # tokens (ids 0-16 in SmolLM2's vocabulary) skipped as the wrapper skips them.
    assert tiny._backend_decode is not None
    assert tiny.decode(ids) == tiny.tokenizer.decode(ids, skip_special_tokens=True)


def test_the_runtime_reads_its_devices_memory(tiny: CausalLMRuntime) -> None:
    # The worker's memory guard reads this: the GPU's own memory on CUDA, RSS on the CPU.
    used, total = tiny.memory()
    if tiny.device.startswith("cuda"):
        assert total == torch.cuda.get_device_properties(tiny.device).total_memory
        assert used >= torch.cuda.memory_allocated(tiny.device) > 0
    else:
        assert total == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        assert 0 < used < total


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_and_the_cpu_give_the_same_greedy_tokens() -> None:
    # float32 on both sides (the toy runtime): the device changes kernels, not answers.
    runtimes = [load_runtime(DeploymentSpec("tiny", RuntimeName.TINY_CAUSAL_LM, device=d))
                for d in ("cpu", "cuda")]
    assert all(isinstance(rt, CausalLMRuntime) for rt in runtimes)
    cpu, cuda = [[alone(rt, p, 12) for p in prompts(rt)] for rt in runtimes
                 if isinstance(rt, CausalLMRuntime)]
    assert cuda == cpu


@pytest.mark.parametrize("device", DEVICES)
def test_a_sequence_whose_logits_turn_nan_fails_alone_and_the_batch_goes_on(
        device: str) -> None:
    """A model's numerical fault on one sequence (here the embedding of a token it
    generates turns NaN, as a half-precision overflow would leave it): from the step that
    feeds that token on, it gets FAILED, steps that still carry it (the worker's
    overlapped step) do not fail, and its neighbours get exactly the tokens they get
    alone, before and after it is dropped. A prompt holding such a token fails at once
    (`add`), beside a neighbour that does not."""
    rt = load_runtime(DeploymentSpec("tiny", RuntimeName.TINY_CAUSAL_LM, device=device))
    assert isinstance(rt, CausalLMRuntime)
    ps = prompts(rt)[:3]
    n = 10
    expected = [alone(rt, p, n) for p in ps]
    # A token the victim generates (3rd to 7th), that nothing else reads or generates.
    seen = {t for i in (0, 1) for t in (*ps[i], *expected[i])}
    step, poison = next((k, t) for k, t in enumerate(expected[2]) if 2 <= k <= n - 3
                        and t not in seen and t not in (*ps[2], *expected[2][:k]))
    # (A hook, not the weights: the toy model's output layer shares them.)
    rt.model.get_input_embeddings().register_forward_hook(
        lambda _module, args, out: out.masked_fill((args[0] == poison)[..., None], torch.nan))
    got: dict[str, list[int]] = {str(i): [t] for i, t in rt.add(
        [NewSequence(str(i), p, SamplingParams(max_tokens=n)) for i, p in enumerate(ps)]
    ).items()}
    while len(got["0"]) < n:
        for rid, token in rt.step().items():
            got[rid].append(token)
        if len(got["2"]) == step + 3:  # failed two steps ago; dropped now
            rt.drop(["2"])
    assert got["2"] == [*expected[2][:step + 1], FAILED, FAILED]
    assert got["0"] == expected[0] and got["1"] == expected[1]
    rt.drop(["0", "1"])
    # In the prompt: that sequence fails on prefill, its neighbour does not notice.
    first = rt.add([NewSequence("bad", [*ps[1], poison]), NewSequence("good", ps[0])])
    assert first == {"bad": FAILED, "good": expected[0][0]}
    assert rt.step()["good"] == expected[0][1]


def test_penalties_follow_openais_formula_in_the_running_batch(tiny: CausalLMRuntime) -> None:
    """Greedy with presence and frequency penalties, beside a neighbour without: the
    tokens a plain forward pass over the whole sequence gives with the penalties applied
    by hand, step by step; a resumed delivery counts what the earlier one generated."""
    prompt = tiny.encode_chat([{"role": "user", "content": "x " * 30}])
    neighbour = prompts(tiny)[1]
    n = 12
    # Negative: they raise what was generated. The toy model never repeats a token in
    # a dozen, so positive penalties would change nothing here (test_sampling.py checks
    # them); these make it repeat.
    params = SamplingParams(max_tokens=n, presence_penalty=-1.5, frequency_penalty=-2.0)
    ids, expected = list(prompt), []
    counts: dict[int, int] = {}
    with torch.inference_mode():
        for _ in range(n):
            logits = tiny.model(input_ids=torch.tensor([ids], device=tiny.device)).logits[0, -1]
            for token, count in counts.items():
                logits[token] -= count * -2.0 + -1.5
            token = int(logits.argmax())
            expected.append(token)
            counts[token] = counts.get(token, 0) + 1
            ids.append(token)
    assert expected != alone(tiny, prompt, n), "the penalties must change this output"
    got = tiny.add([NewSequence("p", prompt, params), NewSequence("q", neighbour)])
    tokens = [got["p"]]
    while len(tokens) < n:
        tokens.append(tiny.step()["p"])
    tiny.drop(["p", "q"])
    assert tokens == expected
    resumed = [tiny.add([NewSequence("r", prompt + expected[:5], params, generated=5)])["r"]]
    while len(resumed) < n - 5:
        resumed.append(tiny.step()["r"])
    tiny.drop(["r"])
    assert resumed == expected[5:]


def test_echo_runtime_returns_the_prompt_then_eos() -> None:
    echo = load_runtime(DeploymentSpec("e", RuntimeName.ECHO))
    assert isinstance(echo, ChatRuntime)
    prompt = echo.encode_chat([{"role": "user", "content": "héllo"}])
    tokens = alone(echo, prompt, len(prompt) + 1)
    assert echo.decode(tokens[:-1]) == "héllo" and tokens[-1] in echo.eos_token_ids


@pytest.mark.slow
@pytest.mark.timeout(300)  # the first load on a fresh machine dequantises the GGUF
@pytest.mark.parametrize("device", DEVICES)
def test_real_chat_model_answers_sensibly(device: str) -> None:
    # bfloat16 on CUDA (CausalLMRuntime.from_folder), float32 on the CPU.
    rt = load_runtime(DeploymentSpec("smol", RuntimeName.CAUSAL_LM, weights=SMOLLM2,
                                     device=device))
    assert isinstance(rt, CausalLMRuntime)
    # transformers 5 would swap layers for kernels fetched from the Hub (its default)
    assert not rt.model.use_kernels
    prompt = rt.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    tokens = alone(rt, prompt, 24)
    cut = next((i for i, t in enumerate(tokens) if t in rt.eos_token_ids), len(tokens))
    answer = rt.decode(tokens[:cut])
    assert "Paris" in answer, answer


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_real_embedder_ranks_similar_above_unrelated(device: str) -> None:
    rt = load_runtime(DeploymentSpec("minilm", RuntimeName.ENCODER, weights=MINILM,
                                     device=device))
    assert isinstance(rt, EncoderRuntime) and rt.dimensions == 384
    assert not rt.model.use_kernels
    vectors, counts = rt.embed(["A cat sits on the mat.", "A kitten is resting on a rug.",
                                "Quarterly corporate tax filing deadlines."])
    v = np.array(vectors)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-4)
    assert v[0] @ v[1] > v[0] @ v[2] + 0.3
    assert all(c > 3 for c in counts)


def test_logprobs_are_the_models_own_for_the_rows_that_ask(tiny: CausalLMRuntime) -> None:
    """Each generated token's log probability and the top ones, from the raw logits
    (a plain forward pass over prompt + tokens gives the same), queued per sequence in
    order; a row that forces a token with logit_bias still gets the model's own
    probability of it; a row that does not ask gets none."""
    import torch

    asks = SamplingParams(max_tokens=6, logprobs=3)
    forced_token = 42
    forcing = SamplingParams(max_tokens=6, logprobs=0, logit_bias=((forced_token, 100.0),))
    p1, p2, p3 = prompts(tiny)[:3]
    seqs = [NewSequence("a", p1, asks), NewSequence("b", p2, SamplingParams(max_tokens=6)),
            NewSequence("c", p3, forcing)]
    out = {rid: [token] for rid, token in tiny.add(seqs).items()}
    for _ in range(5):
        for rid, token in tiny.step().items():
            out[rid].append(token)
    entries = {rid: [tiny.pop_logprob(rid) for _ in range(6)] for rid in "abc"}
    tiny.drop(["a", "b", "c"])
    assert out["c"] == [forced_token] * 6
    assert entries["b"] == [None] * 6 and tiny.pop_logprob("a") is None

    # bfloat16 on a GPU: a decode step's logits are not a whole forward pass's exactly.
    tol = 2e-3 if tiny.device == "cpu" else 0.1
    for rid, prompt in (("a", p1), ("c", p3)):
        ids = torch.tensor([prompt + out[rid]], device=tiny.device)
        with torch.inference_mode():
            logits = tiny.model(input_ids=ids).logits[0].float()
        expected = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        for i, (token, entry) in enumerate(zip(out[rid], entries[rid], strict=True)):
            assert entry is not None
            assert entry.logprob == pytest.approx(expected[i, token].item(), abs=tol)
            values, top_ids = expected[i].topk(3)
            if rid == "a":  # greedy: the token is the most likely; three, best first
                assert entry.top[0][0] == token and len(entry.top) == 3
                assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=tol)
                if tiny.device == "cpu":
                    assert [t for t, _ in entry.top] == top_ids.tolist()
            else:
                assert entry.top == ()  # top_logprobs 0
                assert entry.logprob < -1, "the model's own, not the biased distribution's"
