"""How Sluice's long-running processes use Python's cyclic garbage collector.

Reference counting frees almost everything a request allocates; the cyclic collector
only has to find the cycles (asyncio futures and tasks, exceptions with tracebacks). By
default it runs after every 700 net container allocations and, every tenth or
hundredth run, walks every object the process holds: Django, the app's modules, caches,
a model's weights. Under load that was 15-18% of a gateway process's CPU
(tests/bench/bench_cpu.py; docs/BENCHMARKS.md, "CPU per call, by process").

`tune()` runs once a process has started up:
- `gc.freeze()` moves everything start-up made into a permanent generation that
  collections never walk (it is never garbage: modules, settings, loaded models);
- the youngest generation is collected after YOUNG_THRESHOLD net allocations instead of
  700, so collections are rarer and each still walks only what is young. The older
  generations keep their default ratios, so cycles that live longer are still found.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator

YOUNG_THRESHOLD = 10_000


def tune() -> None:
    """Freeze what exists now and collect the young generation less often."""
    gc.collect()  # what start-up left as garbage goes now, not into the frozen set
    gc.freeze()
    _young, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)


@contextlib.contextmanager
def held(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """No collection inside the block, nor until the callbacks `loop` has scheduled by
    its end have run (`gc.enable` is queued behind them). Nothing is lost: allocations
    are counted meanwhile, and the first one after that triggers the collection due. A
    collector that is off already stays off."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        loop.call_soon(gc.enable)
