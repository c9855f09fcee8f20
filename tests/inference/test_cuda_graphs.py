"""CUDA graphs on the static decode path: a replayed step gives what the same step gives
eagerly (logits and tokens, whatever joins and leaves), each shape is captured once,
the cache is sized from the device's free memory, the real model answers sensibly in
bfloat16. CUDA only: skipped elsewhere (CI has no GPU); tests/bench/gpu_check.sh runs
them on a GPU machine. The CPU side of the same code is test_static_cache.py."""

from __future__ import annotations

import pytest
import torch

from inference.runtimes import load_runtime
from inference.runtimes.base import NewSequence
from inference.runtimes.graphs import graph_batch_sizes
from inference.runtimes.kv import kv_bytes_per_token
from inference.runtimes.static_lm import StaticCausalLMRuntime
from inference.spec import DeploymentSpec, RuntimeName
from inference.weights import SMOLLM2
from tests.inference.test_static_cache import alone, prompts, run_schedule, runtime

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device on this machine")


def static(**extra: object) -> StaticCausalLMRuntime:
    rt = runtime({"decode": "static", **extra}, device="cuda")
    assert isinstance(rt, StaticCausalLMRuntime)
    return rt


def test_replayed_steps_give_the_eager_steps_tokens() -> None:
    """The toy model (float32) on CUDA, graphs on and off, the same buckets: the same
    tokens for random schedules; a second pass over the same shapes captures nothing."""
    graphs = static()
    eager = static(cuda_graphs=False, graph_batch_sizes=list(graph_batch_sizes(8)))
    assert graphs.graphs is not None and eager.graphs is None
    assert graphs.buckets == eager.buckets == graph_batch_sizes(8)
    ps = prompts(graphs)
    for seed in (0, 1, 2):
        assert run_schedule(graphs, ps, seed) == run_schedule(eager, ps, seed)
    captured = set(graphs.graphs.graphs)
    assert captured and {rows for rows, _ in captured} <= set(graph_batch_sizes(8))
    run_schedule(graphs, ps, 0)
    assert set(graphs.graphs.graphs) == captured


def test_graphs_captured_ahead_are_all_that_steps_use() -> None:
    rt = static()
    rt.warm_up()  # what a worker calls before serving: every graph
    captured = len(rt.graphs.graphs)  # type: ignore[union-attr]
    assert captured == len(graph_batch_sizes(8)) * 3  # lengths 64, 128 and 256
    assert rt.capture_graphs() == 0
    ps = prompts(rt)
    got = run_schedule(rt, ps, 0)
    assert len(rt.graphs.graphs) == captured  # type: ignore[union-attr]
    assert got == run_schedule(static(cuda_graphs=False), ps, 0)


def test_replayed_logits_equal_eager_logits() -> None:
    rt = static()
    assert rt.graphs is not None
    ps = prompts(rt)
    rt.add([NewSequence(str(i), p) for i, p in enumerate(ps[:3])])
    rt.step()  # captures (4, 64): three rows padded to the bucket of 4
    rows, length = 4, 64
    assert (rows, length) in rt.graphs.graphs
    with torch.inference_mode():
        eager = rt._forward(rows, length)[:3].clone()
        replayed = rt.graphs.run(rows, length)[:3].clone()
    torch.testing.assert_close(replayed, eager, rtol=0, atol=1e-5)
    rt.drop(rt.active)


def test_static_cuda_tokens_equal_the_dynamic_cuda_runtimes() -> None:
    dynamic = runtime(device="cuda")
    rt = static()
    ps = prompts(rt)
    assert run_schedule(rt, ps, 5) == run_schedule(dynamic, ps, 5)
    for p in ps[:3]:
        assert alone(rt, p, 12) == alone(dynamic, p, 12)


def test_the_cache_is_sized_from_free_memory() -> None:
    """A share of the free memory: a millionth of an H200's is ~270 tokens of the toy
    model, fewer than its 8 slots x 256 positions, so the slots get shorter."""
    _free, total = torch.cuda.mem_get_info()
    dynamic = runtime({"kv_cache_memory_fraction": 1e-6}, device="cuda")
    per_token = kv_bytes_per_token(dynamic.model.config, dynamic.model.dtype)
    assert dynamic.kv_capacity_tokens is not None
    assert 0 < dynamic.kv_capacity_tokens <= total * 1e-6 / per_token
    rt = static(kv_cache_memory_fraction=1e-6)
    assert rt.max_context < 256
    assert rt.kv_capacity_tokens == 8 * rt.max_context <= total * 1e-6 / per_token
    assert runtime(device="cuda").kv_capacity_tokens is not None  # bounded by default


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smollm2_in_bfloat16_answers_sensibly_from_graphs() -> None:
    rt = load_runtime(DeploymentSpec("smol", RuntimeName.CAUSAL_LM, weights=SMOLLM2,
                                     device="cuda", extra={"decode": "static"}))
    assert isinstance(rt, StaticCausalLMRuntime) and rt.graphs is not None
    assert rt.model.dtype == torch.bfloat16
    question = rt.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    # Beside other rows (the batch padded to a bucket): the answer is the same.
    others = [NewSequence(f"o{i}", p) for i, p in enumerate(prompts(rt)[:2])]
    rt.add(others)
    assert "Paris" in rt.decode(alone(rt, question, 24))
    rt.drop(rt.active)
