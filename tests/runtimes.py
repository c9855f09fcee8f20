"""Model runtimes loaded once per test process and lent to the workers that the shared
fixtures start for every test (`live`'s, `tiny`/`roomy`, `thread_worker`): loading
MiniLM from disk or building a toy LM takes tenths of a second to seconds each time.

A runtime is lent to one worker at a time (two workers of one test never share one)
and comes back once that worker has stopped; a stopped worker leaves its runtime with
no sequence (inference/engine/engine.py, `Engine.close`). One that still holds any is
not lent again: what a test left behind stays with that test. Tests that change a
runtime (a fault hook on its model) build their own and never lend it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from inference.runtimes import load_runtime
from inference.runtimes.base import ChatRuntime, EmbeddingRuntime
from inference.spec import DeploymentSpec

Runtime = ChatRuntime | EmbeddingRuntime
_idle: defaultdict[tuple[Any, ...], list[Runtime]] = defaultdict(list)


def _key(spec: DeploymentSpec) -> tuple[Any, ...]:
    """What `load_runtime` builds a runtime from (the name and the queue's settings
    are the worker's, not the runtime's)."""
    return (spec.runtime, spec.weights, spec.device, spec.max_context, spec.max_batch_size,
            spec.echo_token_delay_ms, json.dumps(spec.extra, sort_keys=True, default=str))


def idle(runtime: Runtime) -> bool:
    """Whether `runtime` holds no sequence and no KV cache."""
    if isinstance(runtime, ChatRuntime):
        return not runtime.active and runtime.kv_used_tokens() == 0
    return True


def take(spec: DeploymentSpec) -> Runtime:
    """A runtime for `spec`: this process's idle one if it has one, else a new one."""
    pool = _idle[_key(spec)]
    return pool.pop() if pool else load_runtime(spec)


def give_back(spec: DeploymentSpec, runtime: Runtime) -> None:
    """`runtime`, whose worker has stopped (its thread ended), for the next `take`, if
    it is idle."""
    if idle(runtime):
        prefix = getattr(runtime, "prefix", None)
        if prefix is not None:  # the next test starts with an empty prefix cache
            prefix.clear()
        _idle[_key(spec)].append(runtime)
