"""Local process supervision (sluice/processes.py): real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


# A supervisor as the run command is one: its children, then a wait for a signal, then
# the staged stop. argv: the FRONT child's two files.
SUPERVISOR = """
import sys, time
from sluice.processes import ProcessGroup
group = ProcessGroup()
group.install_signal_handlers()
back = group.start("worker", [sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[2], "w").write(str(back.proc.pid))
group.start("http", [sys.executable, "-c", FRONT, sys.argv[1], sys.argv[2]])
print("ready", flush=True)
group.wait()
group.stop(first=("http",))
print("stopped", flush=True)
""".replace("FRONT", repr(FRONT))


def test_a_terminals_ctrl_c_reaches_the_supervisor_only_and_the_stop_is_staged(
        tmp_path: Path) -> None:
    """Ctrl-C sends SIGINT to the terminal's whole foreground process group. The
    children are in groups of their own: the supervisor alone gets it and stops them
    in stages (a child that got the SIGINT itself would die before draining)."""
    seen, pid_file = tmp_path / "seen", tmp_path / "worker.pid"
    supervisor = subprocess.Popen(  # its own session: the "terminal's" foreground group
        [sys.executable, "-c", SUPERVISOR, str(seen), str(pid_file)],
        stdout=subprocess.PIPE, start_new_session=True, env=os.environ)
    try:
        assert supervisor.stdout is not None
        assert supervisor.stdout.readline().strip() == b"ready"
        time.sleep(0.5)  # the front process has installed its handler
        os.killpg(supervisor.pid, signal.SIGINT)
        out, _ = supervisor.communicate(timeout=20)
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
    assert out.strip() == b"stopped"
    assert seen.read_text() == "alive", "the worker was stopped while the server drained"


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_children_stop_when_their_supervisor_is_killed() -> None:
    starter = ("import sys, time; from sluice.processes import ProcessGroup; "
               "g = ProcessGroup(); c = g.start('worker', [sys.executable, '-c', "
               "'import time; time.sleep(60)']); print(c.proc.pid, flush=True); "
               "time.sleep(60)")
    supervisor = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE,
                                  env=os.environ)
    assert supervisor.stdout is not None
    child = int(supervisor.stdout.readline())
    supervisor.kill()
    supervisor.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _running(child):
        time.sleep(0.05)
    assert not _running(child), "the child outlived its killed supervisor"


def _running(pid: int) -> bool:
    """Alive and not a zombie (a reaped-later child of init counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# Waits on the event in a tight loop, so that a signal often lands while the main thread
# holds the event's lock inside wait(); prints "ready", and exits 0 once the event is set.
WAITER = """
import threading
from sluice.processes import set_on_signals
stop = threading.Event()
set_on_signals(stop)
print("ready", flush=True)
while not stop.is_set():
    stop.wait(0)
"""


def test_a_signal_that_lands_inside_the_wait_on_the_stop_event_still_stops() -> None:
    # A handler that set the event itself deadlocked when the signal came while the main
    # thread held the event's lock in wait() (an autoscaler that ignored SIGTERM in CI).
    # With this loop that race is common: a handler calling event.set() itself left 13
    # of 20 processes hung when tried; each must stop here.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", WAITER], stdout=subprocess.PIPE,
                              env=env) for _ in range(20)]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        time.sleep(0.2)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(timeout=10) for proc in procs] == [0] * 20
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
