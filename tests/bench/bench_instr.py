"""Instructions per governed call, per process: a yardstick the VM's speed does not move.

Wall-clock and CPU-time figures on these shared 2-core VMs swing by 15% (bare uvicorn
by 2x) between adjacent runs of the same code, and the VM exposes no hardware counters
(`perf stat -e instructions` is "not supported"). So this runs the governed setup of
bench_http.py with the gateway, the echo worker and the audit writer each under
valgrind's callgrind, with instrumentation off while they start (`--instr-atstart=no`),
and counts the instructions each executes while a fixed number of calls is driven:

    warm-up calls (uncounted) -> instrumentation on, counters zeroed -> N calls at C
    concurrent connections -> counters dumped -> the same wall time with no calls
    (dumped again: what the processes' timers and background loops cost meanwhile)

It prints instructions per call for each process: raw, and less the idle window's
(background work scaled to the drive's duration). Under valgrind everything runs ~50x
slower, so timers fire ~50x more often per call than at full speed: the idle-corrected
figure is the one to compare, and only against another run of this script (the same
slow-down on both sides). A call's own path is deterministic, but the batching of
concurrent calls (coalesced Redis pipelines, worker steps, recorder flushes) follows
timing: runs of the same code differed by up to +-5% (2026-12; +-1% with fewer
connections), so a smaller change needs several runs a side (measure it: run twice).
Needs valgrind (`apt-get install valgrind`). Linux only.

    .venv/bin/python tests/bench/bench_instr.py [--calls 400] [--connections 8]
        [--warmup 100] [--only sluice,worker,auditwriter]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path

import bench_http as bench

from sluice.localinfra import free_port
from sluice.servers import http_command

BODY = b'{"model": "echo", "messages": [{"role": "user", "content": "hello"}]}'


async def drive(port: int, key: str, calls: int, connections: int) -> int:
    """`calls` POSTs to /v1/chat/completions over `connections` keep-alive connections;
    returns how many were not answered 200."""
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
               b"content-type: application/json\r\nauthorization: Bearer " + key.encode()
               + b"\r\ncontent-length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
    left, failed = calls, 0

    async def one_connection() -> None:
        nonlocal left, failed
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while left > 0:
                left -= 1
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head.split(b" ", 2)[1])
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), None)
                if length is None:
                    raise RuntimeError(f"a reply without content-length: {head!r}")
                await reader.readexactly(length)
                failed += status != 200
        finally:
            writer.close()

    await asyncio.gather(*(one_connection() for _ in range(connections)))
    return failed


def callgrind(pids: list[int], *options: str) -> None:
    subprocess.run(["callgrind_control", *options, *map(str, pids)], check=True,
                   capture_output=True)


def dumped_instructions(paths: set[Path]) -> int:
    """The summed `summary:` (instructions) of callgrind dump files."""
    total = 0
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("summary:"):
                total += int(line.split()[1])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--only", default="sluice,worker,auditwriter",
                        help="the processes to count (the others run at full speed)")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("valgrind is needed: apt-get install valgrind")
    counted = set(args.only.split(","))
    # The same hashes every run: dict and set layouts, so the same paths, both sides.
    with bench.platform(PYTHONHASHSEED="0") as (env, state, group, _private):
        out = Path(state) / "callgrind"
        out.mkdir()

        def under_valgrind(name: str) -> list[str]:
            if name not in counted:
                return []
            return ["valgrind", "-q", "--tool=callgrind", "--instr-atstart=no",
                    "--dump-instr=no", "--compress-strings=no",
                    f"--callgrind-out-file={out}/{name}.%p"]

        key = bench.seed_demo(env)
        bench.govern_demo(env)
        port = free_port()
        bench.start_sluice(group, http_command("uvicorn", "sluice.root.asgi:application",
                                               host="127.0.0.1", port=port),
                           prefix=under_valgrind)
        bench.wait_http(f"http://127.0.0.1:{port}/healthz", timeout=600)
        failed = asyncio.run(drive(port, key, args.warmup, args.connections))
        pids = {name: child.proc.pid for name, child in group.children.items()
                if name in counted}
        callgrind(list(pids.values()), "--instr=on")
        callgrind(list(pids.values()), "--zero")
        began = time.monotonic()
        failed += asyncio.run(drive(port, key, args.calls, args.connections))
        took = time.monotonic() - began
        callgrind(list(pids.values()), "--dump=drive")
        drive_dumps = {name: set(out.glob(f"{name}.{pid}.*"))
                       for name, pid in pids.items()}
        time.sleep(took)
        callgrind(list(pids.values()), "--dump=idle")
        busy = {name: dumped_instructions(files) for name, files in drive_dumps.items()}
        idle = {name: dumped_instructions(set(out.glob(f"{name}.{pid}.*"))
                                          - drive_dumps[name])
                for name, pid in pids.items()}
        print(f"governed /v1/chat/completions, {args.calls} calls over {args.connections} "
              f"connections under callgrind in {took:.0f} s ({failed} not 200); "
              f"then {took:.0f} s idle")
        print(f"{'process':12} {'instr/call':>12} {'idle/call':>11} {'less idle':>12}")
        for name in pids:
            per, idle_per = busy[name] / args.calls, idle[name] / args.calls
            print(f"{name:12} {per:12,.0f} {idle_per:11,.0f} {per - idle_per:12,.0f}")
        total = sum(busy.values()) - sum(idle.values())
        print(f"{'all counted':12} {sum(busy.values()) / args.calls:12,.0f} "
              f"{sum(idle.values()) / args.calls:11,.0f} {total / args.calls:12,.0f}")
        if failed:
            sys.exit(f"{failed} calls were not answered 200")


if __name__ == "__main__":
    main()
