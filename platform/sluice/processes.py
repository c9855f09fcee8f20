"""Local process supervision: start named child processes, stop them all together.

Used by the run command (HTTP server and, as they land, gRPC server, workers, Celery);
the autoscaler builds on the same group to add and remove workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes]


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
            proc = subprocess.Popen(list(argv), env=self.env,  # noqa: S603 - our commands
                                    stdout=sink, stderr=subprocess.STDOUT if sink else None)
        finally:
            if sink is not None:
                sink.close()  # the child holds its own descriptor
        child = Child(name=name, argv=list(argv), proc=proc)
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

    def request_stop(self, *_: object) -> None:
        self._stopping.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGTERM, self.request_stop)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        terminate([child.proc for child in self.children.values()], timeout_s=timeout_s)


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
