"""The sampler (`inference/runtimes/sampling.py`) against what transformers' `generate`
does with the same logits, measured in the same run.

For each case, B rows of logits over SmolLM2's vocabulary (49,152): peaked like a
trained model's (16 tokens +12), with `--flat` of them flat (a high temperature, an
unsure model: their top 1,024 tokens hold less than top_p). Ours: `sample()`, every row
with its own seeded generator. The baseline: transformers' `TemperatureLogitsWarper`
and `TopPLogitsWarper` (a sort of the whole vocabulary per row), softmax and one
`torch.multinomial` for the batch, and the copy of the tokens to the host. Greedy rows:
ours against `argmax`. Times are the median of --rounds rounds, ours and the baseline
alternating; the ratio is ours over the baseline.

    .venv/bin/python tests/bench/bench_sampler.py [--device auto|cpu|cuda]
        [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from inference.runtimes.base import SamplingParams  # noqa: E402
from inference.runtimes.sampling import generator_for, sample  # noqa: E402
from inference.weights import pick_device  # noqa: E402

VOCAB = 49152
# (batch, temperature, top_p, flat rows)
CASES = [(8, 0.0, 1.0, 0), (128, 0.0, 1.0, 0), (8, 1.0, 1.0, 0), (128, 1.0, 1.0, 0),
         (8, 1.0, 0.9, 0), (128, 1.0, 0.9, 0), (128, 1.0, 0.9, 1), (128, 1.0, 0.9, 8)]


def logits_for(batch: int, flat: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, VOCAB, generator=gen)
    logits[:, :16] += 12
    logits[:flat] = torch.randn(flat, VOCAB, generator=gen) * 0.1
    return logits.to(device)


def baseline(temperature: float, top_p: float) -> Callable[[torch.Tensor], list[int]]:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    if temperature <= 0:
        return lambda logits: logits.argmax(dim=-1).tolist()
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))

    def draw(logits: torch.Tensor) -> list[int]:
        for warp in warpers:
            logits = warp(None, logits)
        return torch.multinomial(torch.softmax(logits, dim=-1), 1).squeeze(-1).tolist()

    return draw


def timed_ms(fn: Callable[[], object], device: str, repeat: int) -> float:
    fn()  # warm
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / repeat * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    device = pick_device(args.device)
    torch.set_num_threads(args.threads)
    print(f"device {device}, vocabulary {VOCAB:,}, median of {args.rounds} rounds, "
          f"{args.threads} CPU thread(s)")
    print(f"{'batch':>5} {'T':>4} {'top_p':>5} {'flat':>4} {'sluice ms':>10} "
          f"{'generate ms':>12} {'ratio':>6}")
    for batch, temperature, top_p, flat in CASES:
        logits = logits_for(batch, flat, device)
        params = [SamplingParams(temperature=temperature, top_p=top_p, seed=i)
                  for i in range(batch)]
        generators = [generator_for(p) for p in params]
        theirs = baseline(temperature, top_p)
        repeat = 3 if batch * (top_p < 1.0) >= 128 else 10
        ours_ms, base_ms = [], []
        for _ in range(args.rounds):
            ours_ms.append(timed_ms(lambda: sample(logits, params, generators),  # noqa: B023
                                    device, repeat))
            base_ms.append(timed_ms(lambda: theirs(logits), device, repeat))  # noqa: B023
        ours, base = statistics.median(ours_ms), statistics.median(base_ms)
        print(f"{batch:>5} {temperature:>4} {top_p:>5} {flat:>4} {ours:>10.2f} "
              f"{base:>12.2f} {ours / base:>6.2f}")


if __name__ == "__main__":
    main()
