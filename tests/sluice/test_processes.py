"""Local process supervision (sluice/processes.py): real child processes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from sluice.processes import ProcessGroup

# On SIGTERM, note whether the process named by argv[2] is still alive a moment later
# (a server finishing its in-flight calls needs its workers), then exit.
FRONT = """
import os, signal, sys, time
def stopping(*_):
    time.sleep(0.5)
    try:
        os.kill(int(open(sys.argv[2]).read()), 0)
        alive = "alive"
    except OSError:
        alive = "gone"
    open(sys.argv[1], "w").write(alive)
    sys.exit(0)
signal.signal(signal.SIGTERM, stopping)
while True:
    time.sleep(0.05)
"""


def test_stop_takes_the_servers_down_before_what_they_depend_on(tmp_path: Path) -> None:
    group = ProcessGroup()
    back = group.start("worker", [sys.executable, "-c", "import time; time.sleep(60)"])
    pid_file, seen = tmp_path / "worker.pid", tmp_path / "seen"
    pid_file.write_text(str(back.proc.pid))
    front = group.start("http", [sys.executable, "-c", FRONT, str(seen), str(pid_file)])
    time.sleep(0.5)  # the front process has installed its handler
    group.stop(first=("http",))
    assert seen.read_text() == "alive", "the worker was stopped while the server drained"
    assert front.proc.returncode == 0 and back.proc.returncode is not None
