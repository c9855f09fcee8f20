"""Where a call's CPU goes: CPU time per request of each process of the pipeline.

The governed `/v1/chat/completions` setup of bench_http.py (tenant and model rate
limits, a daily token quota; one echo worker; the audit writer), driven by wrk; each
process's CPU seconds (user + system, children included, from /proc/<pid>/stat) over
the run, divided by the requests served, and the share of the run it spent ready to
run but waiting for a core (/proc/<pid>/task/*/schedstat); then how idle the machine's
cores were. A process that is neither running nor waiting for a core is waiting on the
others. Redis is counted when it runs on this machine (the first `redis-server`
process). Then Redis's own count of each command per request and its time in it
(`INFO commandstats`, reset before the drive: a script's inner commands are counted
too; the server's other clients are counted with it). Linux only.

First, the same for the bare ASGI app (tests/bench/bare_asgi.py, same server, processes
and connections), and wrk's own CPU per request in both runs: the budget line at the
end says how much CPU per request the machine's cores leave at 15% of the bare app's
req/s (the performance issue's goal), against what the pipeline's processes take.

    .venv/bin/python tests/bench/bench_cpu.py [--connections 64] [--seconds 10]
        [--workers N] (gateway processes; default the run command's: one per core,
        up to 4) [--server uvicorn|granian|daphne]
        [--profile] (py-spy each process meanwhile: its top functions by own time;
                     py-spy is installed into the virtualenv on first use)
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import bench_http as bench
import redis

from sluice.localinfra import free_port
from sluice.processes import ProcessGroup
from sluice.servers import http_command
from tests.procstat import cpu_seconds, idle_seconds, process_tree, waited_seconds


def top_frames(raw: Path, n: int = 12) -> list[tuple[float, str]]:
    """The `n` functions with the most own samples in a py-spy raw (collapsed) file."""
    own: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        own[stack.rsplit(";", 1)[-1]] += int(count)
    total = sum(own.values()) or 1
    return [(count / total, frame) for frame, count in own.most_common(n)]


def load_cpu() -> float:
    """CPU seconds of this process's waited-for children: wrk's, around a bench.wrk()."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bare_cost(env: dict[str, str], args: argparse.Namespace) -> tuple[float, float, float]:
    """The bare ASGI app under the same server, processes and load: (req/s, its
    processes' CPU µs per request, wrk's CPU µs per request)."""
    group = ProcessGroup(env)
    try:
        url = bench.start_bare(group, args.server, free_port(), workers=args.workers)
        bench.wait_http(url)
        bench.wrk(url, 8, 2)  # warm-up
        pids = process_tree(group.children["bare"].proc.pid)
        before, load = sum(map(cpu_seconds, pids)), load_cpu()
        result = bench.wrk(url, args.connections, args.seconds)
        used, load = sum(map(cpu_seconds, pids)) - before, load_cpu() - load
    finally:
        group.stop()
    served = result["rps"] * args.seconds
    return result["rps"], used / served * 1e6, load / served * 1e6


def print_commandstats(info: dict[str, dict[str, float]], served: float) -> None:
    """Redis's own count of commands (a script call's inner commands included, as
    Redis counts them) per request, and Redis's time in each per request."""
    rows = sorted(((name.removeprefix("cmdstat_"), row["calls"] / served,
                    row["usec"] / served) for name, row in info.items()),
                  key=lambda r: -r[2])
    print(f"\n{'redis command':22} {'per request':>11} {'µs/request':>11}")
    for name, calls, usec in rows[:14]:
        print(f"{name:22} {calls:11.2f} {usec:11.1f}")


def main() -> None:
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--profile", action="store_true",
                            help="py-spy every process during the run")

    args = bench.wrk_args(__doc__ or "", workers=True, extra=options)
    workers, profile = args.workers, args.profile
    if profile and not Path(sys.executable).with_name("py-spy").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "py-spy"], check=True)
    with bench.platform() as (env, state, group, private):
        bare_rps, bare_us, bare_load_us = bare_cost(env, args)
        print(f"bare ASGI, {workers} {args.server} process(es), {args.connections} "
              f"connections: {bare_rps:.0f} req/s, {bare_us:.0f} µs/request of its "
              f"processes, wrk {bare_load_us:.0f} µs/request")
        key = bench.seed_demo(env)
        bench.govern_demo(env)
        port = free_port()
        bench.start_sluice(group, http_command(args.server, "sluice.root.asgi:application",
                                               host="127.0.0.1", port=port, workers=workers))
        bench.wait_http(f"http://127.0.0.1:{port}/healthz")
        script = Path(state) / "post.lua"
        script.write_text(bench.WRK_LUA % key)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        bench.wrk(url, 8, 2, str(script))  # warm-up
        pids = {name: process_tree(child.proc.pid) for name, child in group.children.items()}
        found = subprocess.run(["pgrep", "-o", "redis-server"], capture_output=True,
                               text=True).stdout.split()
        if found and private is None:
            pids["redis"] = [int(found[0])]
        spies = {name: subprocess.Popen(
            [str(Path(sys.executable).with_name("py-spy")), "record", "--subprocesses",
             "--nonblocking", "-r", "200", "-f", "raw", "-d", str(args.seconds),
             "-o", str(Path(state) / f"{name}.raw"), "-p", str(group.children[name].proc.pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name in (group.children if profile else ())}
        stats = redis.Redis.from_url(env["REDIS_URL"])
        stats.config_resetstat()
        before = {name: sum(map(cpu_seconds, ps)) for name, ps in pids.items()}
        waited = {name: sum(map(waited_seconds, ps)) for name, ps in pids.items()}
        idle, load = idle_seconds(), load_cpu()
        began = time.monotonic()
        result = bench.wrk(url, args.connections, args.seconds, str(script))
        wall, load = time.monotonic() - began, load_cpu() - load
        after = {name: sum(map(cpu_seconds, ps)) for name, ps in pids.items()}
        waited = {name: sum(map(waited_seconds, ps)) - waited[name]
                  for name, ps in pids.items()}
        idle = idle_seconds() - idle
        served = result["rps"] * args.seconds
        print(f"governed /v1/chat/completions, {workers} {args.server} process(es), "
              f"{args.connections} connections: {result['rps']:.0f} req/s, "
              f"p50 {result['p50']:.1f} ms")
        print(f"{'process':12} {'CPU s':>7} {'µs/request':>11} {'of a core':>10} "
              f"{'core wait':>10}")
        total = 0.0
        for name in pids:
            used = after[name] - before[name]
            total += used
            print(f"{name:12} {used:7.2f} {used / served * 1e6:11.0f} {used / wall:10.0%} "
                  f"{waited[name] / wall:10.0%}")
        print(f"{'all':12} {total:7.2f} {total / served * 1e6:11.0f} {total / wall:10.0%}")
        print(f"{'wrk':12} {load:7.2f} {load / served * 1e6:11.0f} {load / wall:10.0%}")
        print(f"cores idle meanwhile: {idle / wall:.0%} of a core, of {os.cpu_count()}")
        cores, goal = os.cpu_count() or 1, 0.15 * bare_rps
        outside = sum(after[n] - before[n] for n in pids if n != "sluice") / served * 1e6
        print(f"budget: at 15% of bare ({goal:,.0f} req/s) {cores} cores leave "
              f"{cores * 1e6 / goal:.0f} µs of CPU per request for every process and wrk; "
              f"the pipeline took {(total + load) / served * 1e6:.0f} with wrk, of which "
              f"{outside:.0f} outside the gateway (worker, audit writer, Redis)")
        print_commandstats(stats.info("commandstats"), served)
        io = stats.info("stats")
        print(f"redis socket reads per request {io['total_reads_processed'] / served:.2f}, "
              f"writes {io['total_writes_processed'] / served:.2f} (each client's write "
              "is a read here: fewer means bigger batches)")
        for name, spy in spies.items():
            spy.wait(30)
            raw = Path(state) / f"{name}.raw"
            if raw.exists():
                print(f"\n{name}: top functions by own time (py-spy, {args.seconds} s; "
                      f"all stacks in {raw})")
                for share, frame in top_frames(raw):
                    print(f"  {share:6.1%}  {frame[:110]}")


if __name__ == "__main__":
    main()
