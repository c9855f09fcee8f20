"""The KV cache's capacity: its settings (range-checked), its size in tokens, and the
admission check a worker calls before `add` (a 400 for a request that can never fit, a
retriable 503 for one that fits later; `add` itself refuses with a typed error rather
than run out of memory). Runs on the CPU; the static cache's own tests are in
test_static_cache.py."""

from __future__ import annotations

import pytest
import torch

from inference.runtimes import load_runtime
from inference.runtimes.base import KVCapacityError, NewSequence, SamplingParams
from inference.runtimes.causal_lm import CausalLMRuntime
from inference.runtimes.kv import DecodeOptions, kv_bytes_per_token, kv_capacity
from inference.spec import DeploymentSpec, RuntimeName


@pytest.mark.parametrize(("extra", "message"), [
    ({"decode": "paged"}, "decode must be one of"),
    ({"kv_cache_tokens": 0}, "kv_cache_tokens must be"),
    ({"kv_cache_tokens": True}, "kv_cache_tokens must be"),
    ({"kv_cache_tokens": 2**31 + 1}, "kv_cache_tokens must be"),
    ({"kv_cache_tokens": "100"}, "kv_cache_tokens must be"),
    ({"kv_cache_memory_fraction": 0}, "kv_cache_memory_fraction must be"),
    ({"kv_cache_memory_fraction": 0.96}, "kv_cache_memory_fraction must be"),
    ({"kv_cache_memory_fraction": float("nan")}, "kv_cache_memory_fraction must be"),
    ({"kv_cache_tokens": 10, "kv_cache_memory_fraction": 0.5}, "not both"),
    ({"cuda_graphs": 1}, "cuda_graphs must be"),
    ({"graph_batch_sizes": [0, 4]}, "graph_batch_sizes must be"),
    ({"graph_batch_sizes": 8}, "graph_batch_sizes must be"),
])
def test_decode_settings_out_of_range_are_refused_by_name(extra: dict[str, object],
                                                          message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecodeOptions.parse(extra, max_batch_size=8)
    with pytest.raises(ValueError, match=message):  # the worker's loader reads them there
        load_runtime(DeploymentSpec("tiny", RuntimeName.TINY_CAUSAL_LM, device="cpu",
                                    extra=extra))


def test_decode_settings_in_range_are_kept() -> None:
    options = DecodeOptions.parse({"decode": "static", "kv_cache_memory_fraction": 0.5,
                                   "graph_batch_sizes": [8, 1, 8, 4], "cuda_graphs": False},
                                  max_batch_size=8)
    assert options == DecodeOptions("static", 8, None, 0.5, False, (1, 4, 8))
    assert DecodeOptions.parse({}, max_batch_size=3) == DecodeOptions(max_batch_size=3)


def test_capacity_from_tokens_a_fraction_or_the_slots() -> None:
    per_token = 1000
    dynamic, static = DecodeOptions(max_batch_size=4), DecodeOptions("static", 4)
    # The CPU, no setting: a dynamic cache is unbounded, a static one has its slots.
    assert kv_capacity(dynamic, bytes_per_token=per_token, device="cpu",
                       max_context=512) is None
    assert kv_capacity(static, bytes_per_token=per_token, device="cpu",
                       max_context=512) == 4 * 512
    # A CUDA device with 10 MB free: a share of it by default, or the share asked for.
    assert kv_capacity(dynamic, bytes_per_token=per_token, device="cuda",
                       max_context=512, free_bytes=10_000_000) == 8500
    half = DecodeOptions(max_batch_size=4, kv_cache_memory_fraction=0.5)
    assert kv_capacity(half, bytes_per_token=per_token, device="cuda", max_context=512,
                       free_bytes=10_000_000) == 5000
    # A static cache never takes more than its slots can use.
    assert kv_capacity(DecodeOptions("static", 4, kv_cache_memory_fraction=0.5),
                       bytes_per_token=per_token, device="cuda", max_context=512,
                       free_bytes=10_000_000) == 2048
    # Tokens: as given, unless the device cannot hold them; a fraction needs a device.
    tokens = DecodeOptions(max_batch_size=4, kv_cache_tokens=3000)
    assert kv_capacity(tokens, bytes_per_token=per_token, device="cpu", max_context=512) \
        == 3000
    with pytest.raises(ValueError, match="GiB free"):
        kv_capacity(tokens, bytes_per_token=per_token, device="cuda", max_context=512,
                    free_bytes=2_000_000)
    with pytest.raises(ValueError, match="on the CPU give kv_cache_tokens"):
        kv_capacity(half, bytes_per_token=per_token, device="cpu", max_context=512)


def tiny(**extra: object) -> CausalLMRuntime:
    rt = load_runtime(DeploymentSpec("tiny", RuntimeName.TINY_CAUSAL_LM, device="cpu",
                                     max_context=256, extra=dict(extra)))
    assert isinstance(rt, CausalLMRuntime)
    return rt


def test_bytes_per_token_are_the_models_keys_and_values() -> None:
    rt = tiny()
    config = rt.model.config
    # 2 layers x 2 KV heads x 16 wide, keys and values, float32 on the CPU.
    assert kv_bytes_per_token(config, torch.float32) == 2 * 2 * 2 * 16 * 4
    assert rt.kv_bytes_per_token == 512
    # What a DynamicCache really holds for one token.
    rt.add([NewSequence("a", [1, 2, 3])])
    layers = rt._cache.layers
    held = sum(t.numel() * t.element_size() for layer in layers
               for t in (layer.keys, layer.values))
    assert held == 3 * rt.kv_bytes_per_token
    rt.drop(["a"])


def test_unbounded_on_the_cpu_by_default() -> None:
    rt = tiny()
    assert rt.kv_capacity_tokens is None
    assert rt.kv_admission(NewSequence("a", [1] * 200)) is None


def test_a_request_larger_than_the_cache_is_a_400_and_a_full_cache_a_503() -> None:
    rt = tiny(kv_cache_tokens=100)
    assert rt.kv_capacity_tokens == 100
    fits = NewSequence("a", [5] * 10, SamplingParams(max_tokens=30))  # reserves 40
    assert rt.kv_admission(fits) is None
    too_big = NewSequence("b", [5] * 10, SamplingParams(max_tokens=95))
    refusal = rt.kv_admission(too_big)
    assert refusal is not None and refusal.status == 400 and not refusal.retriable
    assert (refusal.code, refusal.needed, refusal.capacity) == ("kv_cache_too_small", 105, 100)
    # Two of 40 fit in 100 (2 x 40); a third would make it 3 x 40.
    assert rt.kv_admission(fits, joining=[fits]) is None
    full = rt.kv_admission(fits, joining=[fits, fits])
    assert full is not None and full.status == 503 and full.code == "kv_cache_full"

    rt.add([fits, NewSequence("c", [6] * 10, SamplingParams(max_tokens=30))])
    assert rt.kv_used_tokens() == 2 * 10
    third = NewSequence("d", [7] * 5, SamplingParams(max_tokens=5))
    refused = rt.kv_admission(NewSequence("d", [7] * 20, SamplingParams(max_tokens=20)))
    assert refused is not None and refused.retriable
    # add refuses the same, typed, and changes nothing: the running rows go on.
    with pytest.raises(KVCapacityError) as caught:
        rt.add([NewSequence("d", [7] * 20, SamplingParams(max_tokens=20))])
    assert caught.value.refusal == refused
    assert rt.active == ["a", "c"]
    rt.step()
    assert rt.kv_used_tokens() == 2 * 11
    # The bound is rows x the longest reservation: a short third row is 3 x 40 too.
    assert rt.kv_admission(third) is not None
    rt.drop(["c"])
    assert rt.kv_admission(third) is None
    assert rt.kv_admission(NewSequence("d", [7] * 20, SamplingParams(max_tokens=20))) is None
    rt.drop(["a"])
    assert rt.kv_used_tokens() == 0


def test_a_huge_max_tokens_reserves_no_more_than_the_context() -> None:
    rt = tiny(kv_cache_tokens=512)
    seq = NewSequence("a", [5] * 10, SamplingParams(max_tokens=10**6))
    assert rt.reserved_tokens(seq) == rt.max_context == 256
    assert rt.kv_admission(seq, joining=[seq]) is None
    assert rt.kv_admission(seq, joining=[seq, seq]) is not None
