"""The prefix cache at the runtime alone (no queue, no gateway): a SmolLM2-135M sequence
of a 2,000-token prefix and a 50-token question added to an empty batch (its prefill and
first token: its time to first token inside the worker), a miss (the prefix under a salt
nobody used) against a hit (the same salt and prefix, a new question), interleaved, on
the dynamic and static decode paths; the baseline is the same runtime with the cache
off (`prefix_cache_tokens: 0`) in the same run. tests/bench/gpu_check.sh runs it on CUDA.

    .venv/bin/python tests/bench/bench_prefix_ttft.py [--device cpu|cuda] [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from inference.runtimes import load_runtime  # noqa: E402
from inference.runtimes.base import NewSequence, SamplingParams  # noqa: E402
from inference.runtimes.causal_lm import CausalLMRuntime  # noqa: E402
from inference.spec import DeploymentSpec, RuntimeName  # noqa: E402
from inference.weights import SMOLLM2  # noqa: E402


def timed_add(rt: CausalLMRuntime, ids: list[int], salt: str) -> tuple[float, int]:
    """Seconds to prefill `ids` and sample its first token (synchronised), and how many
    of its tokens the cache gave."""
    import torch

    seq = NewSequence("s", ids, SamplingParams(max_tokens=1), cache_salt=salt)
    began = time.perf_counter()
    rt.add([seq])
    if rt.device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed, cached = time.perf_counter() - began, rt.cached_tokens("s")
    rt.drop(["s"])
    return elapsed, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(46)
    print(f"{'decode':8} {'miss ms':>9} {'hit ms':>9} {'hit/miss':>9} {'cache off ms':>13} "
          f"{'miss/off':>9}")
    for decode in ("dynamic", "static"):
        spec = DeploymentSpec("bench", RuntimeName.CAUSAL_LM, weights=SMOLLM2,
                              device=args.device, max_context=4096, max_batch_size=4,
                              extra={"decode": decode})
        rt = load_runtime(spec)
        off = load_runtime(DeploymentSpec(**{**spec.__dict__,
                                             "extra": {**spec.extra, "prefix_cache_tokens": 0}}))
        assert isinstance(rt, CausalLMRuntime) and isinstance(off, CausalLMRuntime)
        words = [rng.randrange(200, 40_000) for _ in range(2100)]
        timed_add(rt, words[:60], "warm-up")
        timed_add(off, words[:60], "warm-up")
        misses, hits, offs = [], [], []
        for i in range(args.rounds):
            prefix = [rng.randrange(200, 40_000) for _ in range(2000)]
            question = [rng.randrange(200, 40_000) for _ in range(50)]
            miss, cached = timed_add(rt, prefix + question, f"r{i}")
            assert cached == 0
            hit, cached = timed_add(rt, prefix + question[::-1], f"r{i}")
            assert cached == 2000, cached
            misses.append(miss)
            hits.append(hit)
            offs.append(timed_add(off, prefix + question, f"r{i}")[0])
        miss_s, hit_s, off_s = (statistics.median(x) for x in (misses, hits, offs))
        print(f"{decode:8} {miss_s * 1e3:9.1f} {hit_s * 1e3:9.1f} {hit_s / miss_s:9.3f} "
              f"{off_s * 1e3:13.1f} {miss_s / off_s:9.3f}")


if __name__ == "__main__":
    main()
