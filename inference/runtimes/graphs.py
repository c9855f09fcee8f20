"""Static decode steps' shapes, and their CUDA graphs.

A static step runs b >= n rows (the batch padded up to a bucket, `batch_bucket`) over
the first k positions of the slots (the longest row rounded up, `length_bucket`): a
few shapes, each captured once as a CUDA graph and replayed after (`StepGraphs`). This
is what vLLM's and SGLang's runners do for decode (vLLM's CUDAGraphRunner, SGLang's
cuda_graph_runner.py): static input buffers sliced per batch size, the batch padded to
the next captured size with rows that write only where nothing reads, warm-up runs
before each capture, one memory pool shared by every graph, the outputs copied into
one buffer. Their attention kernels read each row's own length; ours is PyTorch's SDPA
over a static number of positions, hence the second bucket (positions).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

MIN_LENGTH_BUCKET = 64  # positions: multiples of 16 keep SDPA's masks aligned on CUDA


def graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The default batch buckets: 1, 2, 4, 8, then steps of 8 to 64, of 16 to 256, of 32
    after (a padded step wastes at most a quarter of its rows past 8), and the largest
    batch itself."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 257, 16),
             *range(288, max_batch_size + 1, 32)]
    return tuple(sorted({s for s in sizes if s < max_batch_size} | {max_batch_size}))


def batch_bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds n rows (n itself past the largest)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else n


def length_bucket(needed: int, limit: int) -> int:
    """Positions a step reads: `needed` rounded up to a power of two (at least
    MIN_LENGTH_BUCKET), at most `limit` (the slots' length)."""
    return min(limit, max(MIN_LENGTH_BUCKET, 1 << (max(needed, 1) - 1).bit_length()))


class StepGraphs:
    """`forward(b, k)` (logits [b, V] of a decode step over the runtime's static
    buffers) captured once per (b, k) and replayed: `run(b, k)` returns the logits
    in `out[:b]`, valid until the next `run`. CUDA only."""

    def __init__(self, forward: Callable[[int, int], torch.Tensor], out: torch.Tensor) -> None:
        self.forward, self.out = forward, out
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def run(self, rows: int, length: int) -> torch.Tensor:
        graph = self.graphs.get((rows, length))
        if graph is None:
            graph = self.graphs[rows, length] = self.capture(rows, length)
        graph.replay()
        return self.out[:rows]

    def capture(self, rows: int, length: int) -> torch.cuda.CUDAGraph:
        """Capture one shape. The warm-up runs (first-use kernel choices must not be
        captured) do what the replay will: they write the same keys and values at the
        same positions, from the inputs already in the buffers."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(rows, length)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the worker's other threads may call CUDA meanwhile (its health
        # thread reads the device's free memory); only this thread's calls are captured.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self.forward(rows, length)
            self.out[:rows].copy_(logits)
            del logits  # freed inside the pool: the next capture reuses its memory
        return graph
