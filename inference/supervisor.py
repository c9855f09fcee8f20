"""Local worker processes: started, stopped and replaced for the autoscaler.

Workers are forked from the autoscaler, which has already imported Django, torch and
the runtimes: a new worker pays only for loading its model, not for starting Python
(the cold start is what `bench_coldstart.py` measures). A worker that dies without
being asked is replaced; one that keeps dying is restarted with a growing delay
(1 s, 2 s, 4 s ... 30 s) rather than in a tight loop.

Stopping is SIGTERM: the worker finishes what it is generating (up to its drain time)
and hands queued entries back, so scaling down loses nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib
import logging
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

from inference.spec import DeploymentSpec

logger = logging.getLogger("sluice.autoscale")
_BACKOFF_MAX_S = 30.0
_CRASH_WINDOW_S = 60.0
_PR_SET_PDEATHSIG = 1


# Imported once by the autoscaler, inherited by every forked worker. transformers imports
# model code lazily, on first use: the architectures the shipped models use (Llama:
# SmolLM2 and the tiny LM; BERT: MiniLM) are named here so that a new worker does not
# pay ~2 s for them on its first load.
PRELOAD = (
    "inference.worker", "inference.runtimes.echo", "inference.runtimes.causal_lm",
    "inference.runtimes.encoder", "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto", "transformers.models.llama.modeling_llama",
    "transformers.models.bert.modeling_bert", "transformers.generation.utils",
    "transformers.tokenization_utils_fast",
)


def preload() -> None:
    """Import what workers need, once, in the parent (forked children inherit it)."""
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError:  # pragma: no cover - a transformers layout change
            logger.warning("could not preload %s", module)


def _child(spec_json: str, redis_url: str) -> None:
    """The forked worker's main: fresh signal handlers, then the worker loop. On Linux
    the kernel sends SIGTERM (drain and exit) if the autoscaler dies: no orphans that a
    new autoscaler would not know about."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    from inference.worker import serve

    serve(DeploymentSpec.from_json(spec_json), redis_url)


@dataclass
class Proc:
    process: BaseProcess
    started: float  # time.monotonic() at spawn
    stopping: bool = False

    @property
    def pid(self) -> int:
        return int(self.process.pid or 0)


@dataclass
class Exit:
    deployment: str
    pid: int
    code: int | None


@dataclass
class Pool:
    """One deployment's processes and its crash history."""

    spec: DeploymentSpec
    procs: list[Proc] = field(default_factory=list)
    crashes: list[float] = field(default_factory=list)
    restart_at: float = 0.0

    def running(self) -> list[Proc]:
        return [p for p in self.procs if not p.stopping]


class Supervisor:
    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.pools: dict[str, Pool] = {}
        self._ctx = multiprocessing.get_context("fork")

    def running(self, deployment: str) -> list[Proc]:
        pool = self.pools.get(deployment)
        return pool.running() if pool else []

    def scale(self, spec: DeploymentSpec, replicas: int, *,
              idle_first: dict[int, int] | None = None) -> list[Proc]:
        """Start or stop processes until `replicas` run; returns the started ones. When
        stopping, the processes with the least load (pid -> load, from heartbeats) go
        first, then the newest."""
        pool = self.pools.setdefault(spec.name, Pool(spec))
        pool.spec = spec
        started: list[Proc] = []
        running = pool.running()
        now = time.monotonic()
        if len(running) < replicas and now < pool.restart_at:
            return started  # crash-looping: wait for the backoff
        for _ in range(replicas - len(running)):
            started.append(self._spawn(pool))
        if len(running) > replicas:
            load = idle_first or {}
            victims = sorted(running, key=lambda p: (load.get(p.pid, 0), -p.started))
            for proc in victims[:len(running) - replicas]:
                self._stop(proc)
        return started

    def _spawn(self, pool: Pool) -> Proc:
        from django.db import connections

        connections.close_all()  # a forked child must not share the parent's sockets
        process = self._ctx.Process(target=_child, args=(pool.spec.to_json(), self.redis_url),
                                    name=f"sluice-worker:{pool.spec.name}", daemon=False)
        process.start()
        proc = Proc(process, time.monotonic())
        pool.procs.append(proc)
        logger.info("started worker pid %s for %s", proc.pid, pool.spec.name)
        return proc

    @staticmethod
    def _stop(proc: Proc, sig: int = signal.SIGTERM) -> None:
        proc.stopping = True
        if proc.process.is_alive():
            os.kill(proc.pid, sig)

    def kill(self, proc: Proc) -> None:
        """SIGKILL a process that will not stop by itself (wedged); not a crash."""
        self._stop(proc, signal.SIGKILL)

    def reap(self) -> list[Exit]:
        """Forget processes that ended; returns those that died unasked (to replace)."""
        died: list[Exit] = []
        now = time.monotonic()
        for name, pool in self.pools.items():
            for proc in list(pool.procs):
                if proc.process.is_alive():
                    continue
                proc.process.join(0)
                pool.procs.remove(proc)
                if proc.stopping:
                    continue
                died.append(Exit(name, proc.pid, proc.process.exitcode))
                pool.crashes = [t for t in pool.crashes if t > now - _CRASH_WINDOW_S] + [now]
                if len(pool.crashes) > 1:
                    delay = min(_BACKOFF_MAX_S, 2.0 ** (len(pool.crashes) - 2))
                    pool.restart_at = now + delay
        return died

    def stop_all(self, timeout_s: float = 15.0) -> None:
        for pool in self.pools.values():
            for proc in pool.procs:
                self._stop(proc)
        deadline = time.monotonic() + timeout_s
        for pool in self.pools.values():
            for proc in pool.procs:
                proc.process.join(max(0.0, deadline - time.monotonic()))
                if proc.process.is_alive():
                    proc.process.kill()
                    proc.process.join()
            pool.procs.clear()
