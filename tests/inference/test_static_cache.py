"""The static decode path (StaticCausalLMRuntime: preallocated slots, static-shape steps):
each sequence's tokens are those of a plain forward pass over its whole text, whatever
joins and leaves around it (random schedules, batches padded to buckets or not, slots
smaller than the model's context); slots are reused and compacted; a sequence reaching
the end of its slot fails alone; a NaN sequence leaves nothing behind in its slot;
resumption, penalties, logprobs and grammar masks behave as on the dynamic path; the
cache's admission check. On the CPU (eagerly); the CUDA graphs' own tests are in
test_cuda_graphs.py."""

from __future__ import annotations

import json
import random

import pytest
import torch

from inference.runtimes import load_runtime
from inference.runtimes.base import FAILED, KVCapacityError, NewSequence, SamplingParams
from inference.runtimes.causal_lm import CausalLMRuntime
from inference.runtimes.graphs import batch_bucket, graph_batch_sizes, length_bucket
from inference.runtimes.kv import DecodeOptions
from inference.runtimes.static_lm import StaticCausalLMRuntime
from inference.spec import DeploymentSpec, RuntimeName
from inference.structured.constraint import Constraint, Vocabulary
from inference.structured.grammar import plan
from inference.weights import SMOLLM2

TEXTS = ["hi", "tell me a story about a dragon and a knight in a castle far away",
         "what is two plus two?", "x " * 40, "Name three rivers.", "a b c d e f g",
         "Write a haiku about the sea and the wind over the harbour at night.", "ok"]


def runtime(extra: dict[str, object] | None = None, *, device: str = "cpu",
            max_batch_size: int = 8) -> CausalLMRuntime:
    rt = load_runtime(DeploymentSpec("tiny", RuntimeName.TINY_CAUSAL_LM, device=device,
                                     max_context=256, max_batch_size=max_batch_size,
                                     extra=extra or {}))
    assert isinstance(rt, CausalLMRuntime)
    return rt


@pytest.fixture(scope="module")
def dynamic() -> CausalLMRuntime:
    return runtime()


@pytest.fixture(scope="module")
def expected(dynamic: CausalLMRuntime) -> dict[str, list[int]]:
    """Each prompt's first 14 greedy tokens by plain forward passes."""
    found = {str(i): plain(dynamic, p, 14) for i, p in enumerate(prompts(dynamic))}
    assert len({tuple(e) for e in found.values()}) == len(TEXTS), "the toy model varies"
    return found


@pytest.fixture(scope="module")
def static() -> StaticCausalLMRuntime:
    rt = runtime({"decode": "static"})
    assert isinstance(rt, StaticCausalLMRuntime)
    return rt


def prompts(rt: CausalLMRuntime) -> list[list[int]]:
    return [rt.encode_chat([{"role": "user", "content": t}]) for t in TEXTS]


@torch.inference_mode()
def plain(rt: CausalLMRuntime, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from plain forward passes over the whole text (no cache at all)."""
    ids = list(prompt)
    for _ in range(n):
        logits = rt.model(input_ids=torch.tensor([ids], device=rt.device)).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def alone(rt: CausalLMRuntime, prompt: list[int], n: int,
          params: SamplingParams | None = None) -> list[int]:
    tokens = [rt.add([NewSequence("solo", prompt, params or SamplingParams())])["solo"]]
    while len(tokens) < n:
        tokens.append(rt.step()["solo"])
    rt.drop(["solo"])
    return tokens


def run_schedule(rt: CausalLMRuntime, ps: list[list[int]], seed: int,
                 ) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Sequences join at random steps (several at once, some mid-generation), each wants
    3 to 14 tokens, and some are cancelled early (dropped mid-generation): the tokens
    each got, and how many each wanted."""
    rng = random.Random(seed)
    wants = {str(i): rng.randint(3, 14) for i in range(len(ps))}
    cancel = {rid: rng.randint(1, n - 1) for rid, n in wants.items() if rng.random() < 0.3}
    joins: dict[int, list[int]] = {}
    for i in range(len(ps)):
        joins.setdefault(rng.randint(0, 10), []).append(i)
    got: dict[str, list[int]] = {}
    step = 0
    while len(got) < len(ps) or rt.active:
        new = [NewSequence(str(i), ps[i]) for i in joins.get(step, [])]
        for rid, token in rt.add(new).items():
            got[rid] = [token]
        for rid, token in rt.step().items():
            got[rid].append(token)
        rt.drop([rid for rid in rt.active
                  if len(got[rid]) >= min(wants[rid], cancel.get(rid, 99))])
        step += 1
    return got, wants


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("extra", [
    {"decode": "static"},
    # Padded to buckets, as on a GPU (rows past the running ones write into free slots).
    {"decode": "static", "graph_batch_sizes": [2, 4, 8]},
    # Slots shorter than the model's context: 8 x 96 tokens.
    {"decode": "static", "kv_cache_tokens": 8 * 96},
], ids=["exact", "buckets", "short-slots"])
def test_random_joins_and_leaves_give_a_plain_forwards_tokens(
        dynamic: CausalLMRuntime, expected: dict[str, list[int]], seed: int,
        extra: dict[str, object]) -> None:
    rt = runtime(extra)
    assert isinstance(rt, StaticCausalLMRuntime)
    ps = prompts(rt)
    got, wants = run_schedule(rt, ps, seed)
    for rid, tokens in got.items():
        assert 1 <= len(tokens) <= wants[rid]
        assert tokens == expected[rid][:len(tokens)], rid
    assert rt.active == [] and rt.kv_used_tokens() == 0
    if "graph_batch_sizes" in extra:  # the dynamic path, same schedule: the same tokens
        assert run_schedule(dynamic, ps, seed)[0] == got


def test_batch_of_one_matches_the_dynamic_runtime(dynamic: CausalLMRuntime,
                                                  static: StaticCausalLMRuntime) -> None:
    for p in prompts(static)[:4]:
        assert alone(static, p, 16) == alone(dynamic, p, 16)


def test_slots_are_reused_and_the_running_rows_stay_first(
        static: StaticCausalLMRuntime) -> None:
    ps = prompts(static)
    expected = [plain(static, p, 8) for p in ps[:5]]
    got = {rid: [t] for rid, t in static.add(
        [NewSequence(str(i), ps[i]) for i in range(3)]).items()}
    for rid, t in static.step().items():
        got[rid].append(t)
    # Row 0 leaves: the last row (2) moves into its slot, keys and values with it.
    static.drop(["0"])
    assert static.active == ["2", "1"]
    assert static._lengths == [len(ps[2]) + 1, len(ps[1]) + 1]
    # Two join: slots 2 and 3, the first free ones.
    for rid, t in static.add([NewSequence("3", ps[3]), NewSequence("4", ps[4])]).items():
        got[rid] = [t]
    assert static.active == ["2", "1", "3", "4"]
    while any(len(got[rid]) < 8 for rid in static.active):
        for rid, t in static.step().items():
            got[rid].append(t)
    static.drop(static.active)
    for i in range(1, 5):
        assert got[str(i)][:8] == expected[i], i


def test_a_sequence_reaching_its_slots_end_fails_alone() -> None:
    """Slots of 64 tokens: a sequence generates until its slot is full (exactly the
    tokens of a plain forward), then gets FAILED for a step the caller did not stop;
    its neighbour goes on unchanged, and its slot serves the next sequence."""
    rt = runtime({"decode": "static", "kv_cache_tokens": 2 * 64}, max_batch_size=2)
    assert rt.max_context == 64 and rt.kv_capacity_tokens == 128
    long, short = [7] * 50, prompts(rt)[0]
    # The slot holds the prompt and 14 tokens fed back; a 15th comes out of the last
    # position (the caller's max_context - prompt is 14: it never feeds that far).
    room = rt.max_context - len(long) + 1
    expected_long, expected_short = plain(rt, long, room), plain(rt, short, room + 2)
    got = {rid: [t] for rid, t in rt.add([NewSequence("l", long), NewSequence("s", short)]
                                         ).items()}
    for _ in range(room + 1):
        for rid, t in rt.step().items():
            got[rid].append(t)
    assert got["l"] == [*expected_long, FAILED, FAILED]
    assert got["s"] == expected_short
    rt.drop(["l"])
    assert alone(rt, prompts(rt)[2], 6) == plain(rt, prompts(rt)[2], 6)
    rt.drop(["s"])


def test_a_nan_sequence_fails_alone_and_leaves_a_clean_slot() -> None:
    rt = runtime({"decode": "static"})
    assert isinstance(rt, StaticCausalLMRuntime)
    ps = prompts(rt)
    n = 10
    expected = [plain(rt, p, n) for p in ps[:4]]
    seen = {t for i in (0, 1, 3) for t in (*ps[i], *expected[i])}
    step, poison = next((k, t) for k, t in enumerate(expected[2]) if 2 <= k <= n - 3
                        and t not in seen and t not in (*ps[2], *expected[2][:k]))
    hook = rt.model.get_input_embeddings().register_forward_hook(
        lambda _module, args, out: out.masked_fill((args[0] == poison)[..., None], torch.nan))
    got = {rid: [t] for rid, t in rt.add(
        [NewSequence(str(i), p) for i, p in enumerate(ps[:3])]).items()}
    while len(got["0"]) < n:
        for rid, t in rt.step().items():
            got[rid].append(t)
    assert got["2"][:step + 1] == expected[2][:step + 1]
    assert set(got["2"][step + 1:]) == {FAILED}
    assert got["0"] == expected[0] and got["1"] == expected[1]
    # Row 0 leaves: the NaN row (2) moves into its slot (its NaN position, the last it
    # wrote, stays behind), and its old slot, now free, is zeroed; a newcomer shorter
    # than it takes that slot (its masked positions are the old sequence's) and gets
    # exactly its own tokens. Then the NaN row leaves: zeroed too.
    values = rt._slots.slot_layers[0].v
    assert not bool(torch.isfinite(values[2]).all())
    rt.drop(["0"])
    assert rt.active == ["2", "1"]
    assert bool(torch.isfinite(values[2]).all())
    hook.remove()
    tokens = [rt.add([NewSequence("3", ps[3])])["3"]]
    assert rt.active == ["2", "1", "3"]
    while len(tokens) < n:
        tokens.append(rt.step()["3"])
    assert tokens == expected[3]
    rt.drop(["2"])
    assert bool(torch.isfinite(values).all())
    rt.drop(["1", "3"])


def test_resumed_penalised_sampled_and_logprob_rows_match_the_dynamic_path(
        dynamic: CausalLMRuntime, static: StaticCausalLMRuntime) -> None:
    """Everything that applies to a step's logits, in one mixed batch on both paths:
    penalties (on a resumed delivery, counting what it generated before), a seeded
    top-p row, logit_bias, logprobs."""
    ps = prompts(static)
    seqs = [
        NewSequence("pen", ps[3] + [11, 12, 11], SamplingParams(
            presence_penalty=-1.5, frequency_penalty=-2.0), generated=3),
        NewSequence("seeded", ps[1], SamplingParams(temperature=1.0, top_p=0.9, seed=7)),
        NewSequence("bias", ps[2], SamplingParams(logit_bias=((42, 100.0),), logprobs=0)),
        NewSequence("lp", ps[0], SamplingParams(logprobs=3)),
    ]
    outputs = []
    for rt in (dynamic, static):
        got = {rid: [t] for rid, t in rt.add(seqs).items()}
        for _ in range(9):
            for rid, t in rt.step().items():
                got[rid].append(t)
        logprobs = {rid: [rt.pop_logprob(rid) for _ in range(10)] for rid in ("bias", "lp")}
        rt.drop(rt.active)
        outputs.append((got, logprobs))
    (got_d, lp_d), (got_s, lp_s) = outputs
    assert got_s == got_d
    assert got_s["bias"] == [42] * 10
    for rid in ("bias", "lp"):
        for a, b in zip(lp_d[rid], lp_s[rid], strict=True):
            assert a is not None and b is not None
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
            assert [t for t, _ in b.top] == [t for t, _ in a.top]


def test_grammar_masks_apply_to_the_static_steps_logits(
        dynamic: CausalLMRuntime, static: StaticCausalLMRuntime) -> None:
    vocab = Vocabulary(static.tokenizer, int(static.model.config.vocab_size),
                       sorted(static.eos_token_ids))
    prompt = prompts(static)[2]
    texts = []
    json_object = plan(response_format={"type": "json_object"})
    assert json_object is not None
    for rt in (dynamic, static):
        constraints = [Constraint(vocab, json_object, budget=64) for _ in range(3)]
        seqs = [NewSequence(f"g{i}", prompt, SamplingParams(temperature=t, seed=i),
                            constraint=c)
                for i, (c, t) in enumerate(zip(constraints, (0.0, 1.0, 1.0), strict=True))]
        rt.add([*seqs, NewSequence("free", prompts(rt)[0])])
        for _ in range(64):
            if all(c.done for c in constraints):
                break
            rt.step()
        rt.drop(rt.active)
        texts.append([rt.decode([t for t in c.emitted if t not in rt.eos_token_ids])
                      for c in constraints])
    assert texts[1] == texts[0]
    for text in texts[1]:
        assert isinstance(json.loads(text), dict), text


def test_no_graphs_off_cuda(static: StaticCausalLMRuntime) -> None:
    assert static.graphs is None and static.buckets == ()
    assert static.capture_graphs() == 0
    static.warm_up()  # nothing to prepare
    assert alone(static, prompts(static)[0], 3)


def test_admission_in_slots() -> None:
    rt = runtime({"decode": "static", "kv_cache_tokens": 2 * 32}, max_batch_size=2)
    assert (rt.max_context, rt.kv_capacity_tokens) == (32, 64)
    long = NewSequence("long", [5] * 32)
    refusal = rt.kv_admission(long)
    assert refusal is not None and refusal.status == 400
    assert refusal.code == "kv_cache_too_small"
    a, b, c = (NewSequence(r, [5] * 10) for r in "abc")
    assert rt.kv_admission(b, joining=[a]) is None
    full = rt.kv_admission(c, joining=[a, b])
    assert full is not None and full.status == 503 and full.code == "kv_cache_full"
    rt.add([a])
    assert rt.kv_used_tokens() == 10
    with pytest.raises(KVCapacityError):
        rt.add([b, c])
    assert rt.active == ["a"]
    rt.step()
    assert rt.kv_used_tokens() == 11
    rt.drop(["a"])
    assert rt.kv_used_tokens() == 0


def test_buckets() -> None:
    assert graph_batch_sizes(8) == (1, 2, 4, 8)
    assert graph_batch_sizes(128) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112,
                                      128)
    assert graph_batch_sizes(100)[-2:] == (96, 100)
    assert graph_batch_sizes(320)[-3:] == (256, 288, 320)
    sizes = graph_batch_sizes(128)
    assert [batch_bucket(n, sizes) for n in (1, 3, 9, 17, 65, 128, 130)] == \
        [1, 4, 16, 24, 80, 128, 130]
    assert [length_bucket(n, 2048) for n in (1, 64, 65, 200, 1025, 5000)] == \
        [64, 64, 128, 256, 2048, 2048]
    assert length_bucket(100, 96) == 96


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_static_tokens_equal_the_dynamic_runtimes() -> None:
    """The real chat model (float32 on the CPU), batch 1 and a batch whose rows join
    and leave mid-generation: the same tokens on both paths (one model, two runtimes)."""
    dynamic = load_runtime(DeploymentSpec("smol", RuntimeName.CAUSAL_LM, weights=SMOLLM2,
                                          device="cpu"))
    assert isinstance(dynamic, CausalLMRuntime)
    static = StaticCausalLMRuntime(dynamic.model, dynamic.tokenizer, device="cpu",
                                   max_context=dynamic.max_context,
                                   options=DecodeOptions("static", max_batch_size=4))
    ps = [static.encode_chat([{"role": "user", "content": t}]) for t in TEXTS[:4]]
    results = [(alone(rt, ps[1], 12), run_schedule(rt, ps, seed=3)[0])
               for rt in (dynamic, static)]
    assert results[1] == results[0]
    question = static.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in static.decode(alone(static, question, 16))
