"""What a process and its descendants use, read from /proc (Linux): for the benchmarks
and the resilience tests that measure a server's CPU or memory."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (a server's worker processes)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        children = []
    return [pid, *(p for child in children for p in process_tree(int(child)))]


def rss_mb(pid: int) -> float:
    """Resident memory of one process, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def tree_rss_mb(pid: int) -> float:
    """Resident memory of `pid` and its descendants, in MB (one that exits meanwhile
    counts nothing)."""
    total = 0.0
    for member in process_tree(pid):
        with contextlib.suppress(OSError):
            total += rss_mb(member)
    return total


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its reaped children, in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of `pid` and its descendants, in seconds."""
    return sum(cpu_seconds(member) for member in process_tree(pid))


def waited_seconds(pid: int) -> float:
    """How long the threads of a process were ready to run but waited for a CPU (the
    scheduler's run-queue delay, /proc/<pid>/task/*/schedstat), in seconds: with the
    CPU time, it tells a process that is short of cores from one that waits on others."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):
                total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def idle_seconds() -> float:
    """Idle time of all the machine's cores together since boot (/proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return (int(fields[3]) + int(fields[4])) / os.sysconf("SC_CLK_TCK")  # idle + iowait
