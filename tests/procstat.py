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

