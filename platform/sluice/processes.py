"""Local process supervision: start named child processes, restart the ones that die
(with a growing delay, giving up on a crash loop), stop them (servers first).

Used by the run command (HTTP server, gRPC server, autoscaler, audit writer, Celery) and
the benchmarks. Model workers are the autoscaler's own children (inference/supervisor.py).

Each child runs in a process group of its own, so a terminal's Ctrl-C (SIGINT to the
foreground group) or hang-up reaches only the supervisor, which then stops the children
in stages; on Linux each child also gets SIGTERM if the supervisor dies without that
(killed), instead of living on with its ports.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _die_with(parent: int) -> Callable[[], None] | None:
    """For Popen's preexec_fn (in the child, before exec; nothing there may import or
    lock): SIGTERM when `parent` dies, and exit at once if it already has. Linux sends
    it when the thread that started the child ends: groups are run from the main one."""
    if _prctl is None:
        return None
    prctl = _prctl

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def set_on_signals(event: threading.Event,
                   signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Set `event` when one of `signals` arrives: how a long-running process is asked to
    stop. A handler runs in the main thread between two bytecodes, which may be inside
    that thread's own `event.wait()` with the event's lock held; `event.set()` there
    waits for that lock forever (an autoscaler that never stopped, in a CI run). So the
    handler hands the set to a thread of its own, which takes the lock once the main
    thread lets go of it."""

    def handler(*_: object) -> None:
        threading.Thread(target=event.set, name="sluice-signal", daemon=True).start()

    for sig in signals:
        signal.signal(sig, handler)


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes]
    output: Path | None = None
    exits: list[float] = field(default_factory=list)  # recent unasked exits (monotonic)
    restart_at: float | None = None


class ProcessGroup:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = env or dict(os.environ)
        self.children: dict[str, Child] = {}
        self._stopping = threading.Event()

    def start(self, name: str, argv: Sequence[str], *, output: Path | None = None) -> Child:
        """Start `argv` as `name`; its stdout and stderr go to `output` (appended) when
        given, else to ours."""
        sink = output.open("ab") if output is not None else None
        try:
            proc = subprocess.Popen(  # noqa: S603 - our commands
                list(argv), env=self.env, stdout=sink,
                stderr=subprocess.STDOUT if sink else None,
                process_group=0, preexec_fn=_die_with(os.getpid()))
        finally:
            if sink is not None:
                sink.close()  # the child holds its own descriptor
        child = Child(name=name, argv=list(argv), proc=proc, output=output)
        previous = self.children.get(name)
        if previous is not None:
            child.exits = previous.exits
        self.children[name] = child
        return child

    def wait(self, poll_s: float = 0.2) -> tuple[str, int] | None:
        """Block until stop() is called or a child exits; returns (name, code) of the
        first child that exited on its own, None after a requested stop."""
        while not self._stopping.is_set():
            for child in self.children.values():
                code = child.proc.poll()
                if code is not None:
                    return child.name, code
            self._stopping.wait(poll_s)
        return None

    def supervise(self, *, on_restart: Callable[[str, int, float], None] | None = None,
                  poll_s: float = 0.2, max_exits: int = 5,
                  window_s: float = 60.0) -> tuple[str, int] | None:
        """Like wait(), but a child that exits on its own is started again, after 0 s,
        then 1 s, 2 s, 4 s... (capped at 30 s); one that exits more than `max_exits`
        times within `window_s` is given up on: returns its (name, code)."""
        while not self._stopping.is_set():
            now = time.monotonic()
            for child in list(self.children.values()):
                code = child.proc.poll()
                if code is None:
                    continue
                if child.restart_at is None:
                    child.exits = [t for t in child.exits if t > now - window_s] + [now]
                    if len(child.exits) > max_exits:
                        return child.name, code
                    delay = 0.0 if len(child.exits) == 1 else min(
                        30.0, 2.0 ** (len(child.exits) - 2))
                    child.restart_at = now + delay
                    if on_restart is not None:
                        on_restart(child.name, code, delay)
                if now >= child.restart_at:
                    self.start(child.name, child.argv, output=child.output)
            self._stopping.wait(poll_s)
        return None

    def install_signal_handlers(self) -> None:
        set_on_signals(self._stopping, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

    def stop(self, timeout_s: float = 10.0, *, first: Sequence[str] = ()) -> None:
        """Stop every child: those named in `first` before the rest, and each stage
        waited for. The run command stops its servers first, so that the calls they are
        finishing still have workers and Redis writers behind them."""
        self._stopping.set()
        front = [c.proc for name, c in self.children.items() if name in first]
        terminate(front, timeout_s=timeout_s)
        terminate([c.proc for name, c in self.children.items() if name not in first],
                  timeout_s=timeout_s)


def terminate(procs: Sequence[subprocess.Popen[bytes]], *, timeout_s: float = 10.0) -> None:
    """SIGTERM every process, SIGKILL what is still alive after the timeout."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
