"""Throughput of two gateways on two nodes against one gateway, in one run (issue #32).

The nodes of the multi-node test (tests/cluster/netns.py) without faults: PostgreSQL
with the audit writer, one Redis, two gateways and two echo workers (no token delay,
batches of 64), each on its own node. A closed loop of `--clients` concurrent callers
(httpx, keep-alive, non-streamed chat calls) sends to gateway 1 alone ("one") or to
both, half each ("two"), for `--seconds`, the modes alternating for `--rounds` rounds
so both see the same moments of a machine whose speed drifts. Per phase: calls a second,
the machine's busy share of its cores, each gateway's and the client's CPU seconds. The
ratio two/one is bounded by the machine: every node shares its cores, so once they are
busy a second gateway only moves CPU from one process to another.

    sudo .venv/bin/python -m tests.cluster.bench_gateways [--seconds 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _phase(bases: list[str], key: str, model: str, clients: int, seconds: float
           ) -> tuple[int, int]:
    """Closed loop for `seconds`: (calls answered, calls failed)."""
    import httpx

    async def run() -> tuple[int, int]:
        ok = failed = 0
        stop = time.monotonic() + seconds
        body = {"model": model, "messages": [{"role": "user", "content": "hello there"}]}
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(
                max_connections=clients), headers={"Authorization": f"Bearer {key}"}) as http:
            async def caller(n: int) -> None:
                nonlocal ok, failed
                url = f"{bases[n % len(bases)]}/v1/chat/completions"
                while time.monotonic() < stop:
                    reply = await http.post(url, json=body)
                    if reply.status_code == 200:
                        ok += 1
                    else:
                        failed += 1
            await asyncio.gather(*(caller(n) for n in range(clients)))
        return ok, failed

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sluice.settings.test")
    import django

    django.setup()
    from tests.cluster import netns, services
    from tests.procstat import cpu_seconds, idle_seconds

    reason = netns.unavailable() or services.missing_tools()
    if reason is not None:
        raise SystemExit(f"cannot run: {reason}")
    fabric = netns.Fabric.create()
    folder = Path(tempfile.mkdtemp(prefix="slc-bench-"))
    pg_data = Path(tempfile.mkdtemp(prefix="slc-pg-"))
    logs = services.Logs(folder)
    try:
        nodes = {n: fabric.node(n) for n in ("pg", "redis", "gw1", "gw2", "w1", "w2")}
        database_url = services.start_postgres(nodes["pg"], pg_data, logs)
        redis_url = services.start_redis(nodes["redis"], folder, logs)
        platform = services.Platform(database_url, redis_url, logs, folder, 30)
        seed = platform.ops("seed", "--echo-delay-ms", "0", "--batch", "64")
        platform.start_auditwriter(nodes["pg"])
        bases = [platform.start_gateway(nodes["gw1"]), platform.start_gateway(nodes["gw2"])]
        gateways = [nodes["gw1"].procs[0].pid, nodes["gw2"].procs[0].pid]
        for worker in ("w1", "w2"):
            platform.start_worker(nodes[worker], seed["spec"], seed["model"])
        key, model = seed["keys"]["fault"], seed["model"]
        _phase(bases, key, model, args.clients, 2.0)  # warm both gateways' caches
        cores = os.cpu_count() or 1
        rates: dict[str, list[float]] = {"one": [], "two": []}
        print(f"load average before: {os.getloadavg()[0]:.1f}")
        print(f"{'mode':5} {'calls/s':>8} {'failed':>6} {'busy':>5} {'gw1 cpu':>8} "
              f"{'gw2 cpu':>8} {'gw ms/call':>10} {'client cpu':>10}")
        for _round in range(args.rounds):
            for mode in ("one", "two"):
                targets = bases[:1] if mode == "one" else bases
                cpu: list[Any] = [cpu_seconds(p) for p in gateways]
                idle, client, began = idle_seconds(), time.process_time(), time.monotonic()
                ok, failed = _phase(targets, key, model, args.clients, args.seconds)
                wall = time.monotonic() - began
                busy = 1 - (idle_seconds() - idle) / (wall * cores)
                cpu = [cpu_seconds(p) - c for p, c in zip(gateways, cpu, strict=True)]
                rates[mode].append(ok / wall)
                print(f"{mode:5} {ok / wall:8.1f} {failed:6d} {busy:5.0%} {cpu[0]:8.2f} "
                      f"{cpu[1]:8.2f} {1000 * sum(cpu) / max(ok, 1):10.2f} "
                      f"{time.process_time() - client:10.2f}")
        one, two = statistics.median(rates["one"]), statistics.median(rates["two"])
        print(f"median calls/s: one gateway {one:.1f}, two gateways {two:.1f}, "
              f"two/one {two / one:.2f}x ({cores} cores; load average after "
              f"{os.getloadavg()[0]:.1f})")
    finally:
        fabric.close()
        logs.close()
        for path in (pg_data, folder):
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
