"""The prefix cache (inference/runtimes/prefix_cache.py, prefill.py): a prompt whose
leading blocks are cached decodes the same tokens as one prefilled whole, on the
dynamic and the static decode paths: random prefixes, block boundaries, eviction under
pressure, a sequence taken over from another worker, a cancelled one; `n` sequences
with one prompt prefill it once; the tenant salt keeps tenants apart, in hits and in
time; a faulted row stores nothing; the pool's LRU keeps a chain's head longest."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence

import pytest
import torch

from inference.runtimes.base import NewSequence, SamplingParams
from inference.runtimes.causal_lm import CausalLMRuntime, tiny_llama
from inference.runtimes.kv import DecodeOptions, kv_budget
from inference.runtimes.prefix_cache import PrefixCache
from inference.runtimes.static_lm import StaticCausalLMRuntime

CONTEXT = 512
PATHS = [(CausalLMRuntime, "dynamic"), (StaticCausalLMRuntime, "static")]


@pytest.fixture(scope="module")
def tiny() -> tuple[object, object]:
    return tiny_llama(max_context=CONTEXT)


def runtime(tiny: tuple[object, object], cls: type[CausalLMRuntime], decode: str, *,
            pool: int | None = None, block: int = 8) -> CausalLMRuntime:
    model, tokenizer = tiny
    return cls(model, tokenizer, device="cpu", max_context=CONTEXT,
               options=DecodeOptions(decode, prefix_cache_tokens=pool,
                                     prefix_block_tokens=block))


def generate(rt: CausalLMRuntime, seqs: Sequence[NewSequence], steps: int = 6,
             *, keep: bool = False) -> dict[str, list[int]]:
    """Each sequence's first `steps` + 1 tokens (added together); dropped unless `keep`."""
    out: dict[str, list[int]] = {s.rid: [] for s in seqs}
    for rid, token in rt.add(seqs).items():
        out[rid].append(token)
    for _ in range(steps):
        for rid, token in rt.step().items():
            if rid in out:  # not another sequence running beside them
                out[rid].append(token)
    if not keep:
        rt.drop([s.rid for s in seqs])
    return out


def seq(rid: str, ids: list[int], salt: str = "tenant-a", **params: object) -> NewSequence:
    params = {"max_tokens": 50, **params}
    return NewSequence(rid, ids, SamplingParams(**params),  # type: ignore[arg-type]
                       cache_salt=salt)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40_000) for _ in range(n)]


@pytest.mark.parametrize(("cls", "decode"), PATHS)
def test_hits_decode_the_tokens_of_a_whole_prefill(tiny: tuple[object, object],
                                                   cls: type[CausalLMRuntime],
                                                   decode: str) -> None:
    """Random prompts sharing random prefixes, three at a time (rows with and without
    hits in one pass), and every length around a block boundary."""
    cold = runtime(tiny, cls, decode, pool=0)
    warm = runtime(tiny, cls, decode)
    assert cold.prefix is None and warm.prefix is not None
    rng = random.Random(7)
    shared = tokens(rng, 120)
    batches = [[seq(f"r{t}-{i}", shared[:rng.randrange(1, 120)] + tokens(rng, rng.randrange(1, 20)))
                for i in range(3)] for t in range(12)]
    batches += [[seq(f"edge{n}", shared[:n])] for n in (7, 8, 9, 15, 16, 17, 24, 25)]
    for batch in batches:
        assert generate(warm, batch) == generate(cold, batch)
    stats = warm.prefix.stats
    assert stats.hits > 10 and stats.hit_tokens >= 8 * stats.hits
    # At most all but the prompt's last token come from the cache.
    rt = runtime(tiny, cls, decode)
    generate(rt, [seq("a", shared[:16])])
    rt.add([seq("b", shared[:16])])
    assert rt.cached_tokens("b") == 8  # the first block; the second holds the last token
    rt.drop(["b"])
    assert rt.cached_tokens("b") == 0


@pytest.mark.parametrize(("cls", "decode"), PATHS)
def test_eviction_under_pressure_keeps_results_exact(tiny: tuple[object, object],
                                                     cls: type[CausalLMRuntime],
                                                     decode: str) -> None:
    cold = runtime(tiny, cls, decode, pool=0)
    warm = runtime(tiny, cls, decode, pool=32)  # four blocks of 8
    rng = random.Random(3)
    prefixes = [tokens(rng, 40) for _ in range(4)]
    for i in range(24):
        prompt = prefixes[rng.randrange(4)][:rng.randrange(9, 40)] + tokens(rng, 3)
        assert generate(warm, [seq(f"p{i}", prompt)]) == generate(cold, [seq(f"p{i}", prompt)])
        assert len(warm.prefix) <= 4  # type: ignore[arg-type]
    assert warm.prefix is not None and warm.prefix.stats.evictions > 0
    assert warm.prefix.stats.hits > 0


def test_eviction_takes_a_chains_tail_before_its_head() -> None:
    pool = PrefixCache(capacity_blocks=3, block_tokens=2)
    kv = torch.zeros((1, 2, 1, 8, 1))
    chain = pool.block_keys("t", [1, 2, 3, 4, 5, 6])
    pool.store(chain, 0, kv)
    other = pool.block_keys("t", [9, 9])
    pool.store(other, 0, kv)  # one block over: the chain's last block goes
    assert pool.match(chain, 3) == 2 and pool.match(other, 1) == 1
    assert pool.stats.evictions == 1
    # Another tenant's identical tokens are other blocks.
    assert pool.block_keys("u", [1, 2]) != chain[:1]
    assert pool.match(pool.block_keys("u", [1, 2, 3, 4, 5, 6]), 3) == 0


@pytest.mark.parametrize(("cls", "decode"), PATHS)
def test_a_sequence_taken_over_by_another_worker(tiny: tuple[object, object],
                                                 cls: type[CausalLMRuntime],
                                                 decode: str) -> None:
    """Worker 2 resumes a request worker 1 started (its prompt then what was streamed),
    its cache warm with the same prefix from another request: the same tokens."""
    rng = random.Random(5)
    prompt = tokens(rng, 50)
    first = runtime(tiny, cls, decode, pool=0)
    whole = generate(first, [seq("r", prompt)], steps=10)["r"]
    second = runtime(tiny, cls, decode)
    generate(second, [seq("other", prompt[:40] + tokens(rng, 5))])
    resumed = NewSequence("r", prompt + whole[:4], SamplingParams(max_tokens=50),
                          generated=4, cache_salt="tenant-a")
    out = generate(second, [resumed], steps=6)["r"]
    assert second.prefix is not None and second.prefix.stats.hits == 1
    assert out == whole[4:11]


@pytest.mark.parametrize(("cls", "decode"), PATHS)
def test_a_cancelled_sequence_leaves_usable_blocks(tiny: tuple[object, object],
                                                   cls: type[CausalLMRuntime],
                                                   decode: str) -> None:
    rng = random.Random(11)
    prompt = tokens(rng, 64)
    cold = runtime(tiny, cls, decode, pool=0)
    warm = runtime(tiny, cls, decode)
    running = [seq("long", tokens(rng, 30))]
    generate(warm, running, keep=True)
    warm.add([seq("cancelled", prompt)])
    warm.step()
    warm.drop(["cancelled"])  # cancelled mid-way, beside a running sequence
    again = generate(warm, [seq("again", prompt)])
    assert again == generate(cold, [seq("again", prompt)])
    assert warm.prefix is not None and warm.prefix.stats.hit_tokens == 56


@pytest.mark.parametrize(("cls", "decode"), PATHS)
def test_n_choices_prefill_their_prompt_once(tiny: tuple[object, object],
                                             cls: type[CausalLMRuntime],
                                             decode: str) -> None:
    rng = random.Random(2)
    prompt = tokens(rng, 30)
    rt = runtime(tiny, cls, decode)
    choices = [seq(f"c{i}", prompt, temperature=1.0, seed=i) for i in range(3)]
    calls: list[int] = []
    hook = rt.model.register_forward_hook(lambda _m, args, _o: calls.append(1))
    try:
        together = generate(rt, choices, keep=True)
        cached = [rt.cached_tokens(s.rid) for s in choices]
    finally:
        hook.remove()
    rt.drop([s.rid for s in choices])
    assert cached == [0, 30, 30] and len(calls) == 1 + 6  # one prefill, six steps
    alone = runtime(tiny, cls, decode, pool=0)
    for choice in choices:
        assert generate(alone, [choice])[choice.rid] == together[choice.rid]
    assert len({tuple(t) for t in together.values()}) > 1  # three draws, not one copied


def test_another_tenant_gets_no_hit() -> None:
    pool = PrefixCache(capacity_blocks=64, block_tokens=4)
    ids = list(range(100, 140))
    pool.store(pool.block_keys("a\x1f", ids), 0, torch.zeros((1, 2, 1, 40, 1)))
    assert pool.match(pool.block_keys("a\x1f", ids), 9) == 9
    assert pool.match(pool.block_keys("b\x1f", ids), 9) == 0
    assert pool.match(pool.block_keys("a\x1fkey-2", ids), 9) == 0  # narrowed per key


def test_a_faulted_row_stores_nothing(tiny: tuple[object, object]) -> None:
    rt = runtime(tiny, CausalLMRuntime, "dynamic")
    hook = rt.model.lm_head.register_forward_hook(
        lambda _m, _a, out: out.fill_(float("nan")))
    try:
        rt.add([seq("nan", list(range(300, 340)))])
    finally:
        hook.remove()
    rt.drop(["nan"])
    assert rt.prefix is not None and len(rt.prefix) == 0


def test_the_pool_is_sized_from_the_kv_setting() -> None:
    per_token = 1000
    assert kv_budget(DecodeOptions(), bytes_per_token=per_token, device="cpu",
                     max_context=512) == (None, 4 * 512)
    assert kv_budget(DecodeOptions(kv_cache_tokens=4000), bytes_per_token=per_token,
                     device="cpu", max_context=512) == (4000, 1000)
    assert kv_budget(DecodeOptions(prefix_cache_tokens=0), bytes_per_token=per_token,
                     device="cpu", max_context=512) == (None, 0)
    # From free memory (CUDA): the pool is taken from the fraction, not added to it.
    cache, pool = kv_budget(DecodeOptions(), bytes_per_token=per_token, device="cuda",
                            max_context=512, free_bytes=10_000_000)
    assert cache + pool == 8500 and pool == 1700
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        kv_budget(DecodeOptions(kv_cache_tokens=9000, prefix_cache_tokens=2000),
                  bytes_per_token=per_token, device="cuda", max_context=512,
                  free_bytes=10_000_000)
    with pytest.raises(ValueError, match="prefix_block_tokens"):
        DecodeOptions.parse({"prefix_block_tokens": 0}, max_batch_size=4)
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        DecodeOptions.parse({"prefix_cache_tokens": -1}, max_batch_size=4)


def test_another_tenants_prefix_costs_a_miss_in_time(tiny: tuple[object, object]) -> None:
    """The timing side channel: tenant B sending tenant A's cached prefix takes as long
    as a prefix nobody sent (medians of interleaved samples within noise), while A's
    own hit is clearly faster (the measurement can tell a hit)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = tiny[1]
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024)
    rt = CausalLMRuntime(LlamaForCausalLM(config), tokenizer, device="cpu", max_context=1024,
                         options=DecodeOptions(prefix_cache_tokens=8192))
    rng = random.Random(1)
    prefix = [rng.randrange(4096) for _ in range(600)]
    rt.add([seq("warm", [*prefix, 1], salt="a")])
    rt.drop(["warm"])

    def prefill_s(rid: str, ids: list[int], salt: str) -> float:
        started = time.perf_counter()
        rt.add([seq(rid, ids, salt=salt, max_tokens=1)])
        elapsed = time.perf_counter() - started
        cached = rt.cached_tokens(rid)
        rt.drop([rid])
        if salt != "a":
            assert cached == 0
        return elapsed

    own, other, fresh = [], [], []
    for i in range(15):
        tail = [rng.randrange(4096) for _ in range(8)]
        other.append(prefill_s(f"b{i}", prefix + tail, f"b{i}"))
        fresh.append(prefill_s(f"c{i}", [rng.randrange(4096) for _ in range(600)] + tail,
                               f"c{i}"))
        own.append(prefill_s(f"a{i}", prefix + tail, "a"))
    ratio = statistics.median(other) / statistics.median(fresh)
    assert 0.6 < ratio < 1.6, (ratio, other, fresh)
    assert statistics.median(own) < 0.5 * statistics.median(fresh)
