"""Upstream routing overhead (issue #33): the latency and the CPU per call that routing
through an upstream deployment adds, against calling that upstream directly, in one run.

One platform (SQLite in a temporary state dir; a private Redis unless
SLUICE_BENCH_REDIS_URL names one, so that its CPU is this run's alone):
  upstream  a Sluice gateway (uvicorn, one process), an echo worker and the audit
            writer: the server every call ends at
  front     a second Sluice gateway (one process) and an upstream worker for the
            deployment "up" (openai_upstream: the upstream's echo model, dialect sluice,
            the demo key); the alias "bench/up" over it
Modes, each from one keep-alive connection (Python http.client), one call at a time:
  direct    the upstream's /v1/chat/completions, model "echo": the baseline
  upstream  the front's, model "up" (the upstream deployment by name)
  alias     the front's, model "bench/up" (the alias: its plan, then "up")
Latency: --calls rounds of one call per mode in a shuffled order; p50/p90/p99/mean per
mode, and each mode's added p50 over direct (the goal: 2 ms at most). CPU: then --calls
more per mode in blocks of --block calls of one mode, alternating; every process's user
+ system time (/proc; Redis included when it is private) summed over each mode's
blocks, per call, and what each mode adds over direct.
The body is a short non-streamed chat call ("hello"; the upstream worker then asks the
upstream for one JSON reply too).
--worker-from DIR adds a mode, "other": the deployment "up-b" (the same upstream),
served by the upstream worker of the checkout at DIR (a `git worktree` of another
revision), so two revisions' upstream workers are measured in the same run, behind the
same front gateway, their calls alternated.

    .venv/bin/python tests/bench/bench_upstream.py [--calls 2000] [--block 100]
        [--worker-from DIR]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench_http as bench
import redis

from sluice.localinfra import free_port
from sluice.servers import http_command
from tests.procstat import cpu_seconds, process_tree

MODES = {"direct": "echo", "upstream": "up", "alias": "bench/up"}
GOAL_MS = 2.0


def register_upstream(env: dict[str, str], *, base_url: str, key: str,
                      names: tuple[str, ...] = ("up",)) -> None:
    """The deployments `names` (the upstream's echo model, the demo key sealed) and the
    alias "bench/up" over the first."""
    script = (
        "import django; django.setup(); "
        "from inference.models import AliasTarget, Deployment, ModelAlias; "
        "from inference.upstream.secrets import seal; "
        f"ups = [Deployment.objects.create(name=name, runtime='openai_upstream', "
        f"upstream_url={base_url!r}, upstream_model='echo', upstream_dialect='sluice', "
        f"upstream_secret=seal({key!r}), upstream_concurrency=64, max_context=2048) "
        f"for name in {list(names)!r}]; up = ups[0]; "
        "alias = ModelAlias.objects.create(name='bench/up'); "
        "AliasTarget.objects.create(alias=alias, deployment=up, weight=1)")
    subprocess.run([sys.executable, "-c", script], cwd=bench.REPO, env=env, check=True)


def percentile(values: list[float], p: float) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * p))]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="per mode")
    parser.add_argument("--block", type=int, default=100)
    parser.add_argument("--worker-from", metavar="DIR",
                        help="also serve up-b with the upstream worker of this checkout")
    args = parser.parse_args()
    modes = dict(MODES)
    if args.worker_from:
        modes["other"] = "up-b"
    os.environ.setdefault("SLUICE_BENCH_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    with bench.platform(SLUICE_UPSTREAM_ALLOW_PRIVATE="true") as (env, _state, group, private):
        key = bench.seed_demo(env)
        up_port, front_port = free_port(), free_port()
        register_upstream(env, base_url=f"http://127.0.0.1:{up_port}/v1", key=key,
                          names=("up", "up-b") if args.worker_from else ("up",))
        bench.start_sluice(group, http_command("uvicorn", "sluice.root.asgi:application",
                                               host="127.0.0.1", port=up_port, workers=1))
        group.start("front", http_command("uvicorn", "sluice.root.asgi:application",
                                          host="127.0.0.1", port=front_port, workers=1))
        group.start("upstream worker", [sys.executable, str(bench.REPO / "manage.py"),
                                        "runworker", "--deployment", "up"])
        if args.worker_from:
            other = Path(args.worker_from).resolve()
            group.start("upstream worker b", [
                # Its own directory as the working one too: it is put on sys.path.
                "env", "-C", str(other), f"PYTHONPATH={other}{os.pathsep}{other / 'platform'}",
                sys.executable, str(other / "manage.py"), "runworker", "--deployment", "up-b"])
        for port in (up_port, front_port):
            bench.wait_http(f"http://127.0.0.1:{port}/healthz")
        ports = {"direct": up_port, "upstream": front_port, "alias": front_port,
                 "other": front_port}
        conns = {mode: http.client.HTTPConnection("127.0.0.1", ports[mode])
                 for mode in modes}

        def call(mode: str) -> float:
            body = json.dumps({"model": modes[mode],
                               "messages": [{"role": "user", "content": "hello"}]})
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
            began = time.perf_counter()
            try:
                conns[mode].request("POST", "/v1/chat/completions", body, headers)
                reply = conns[mode].getresponse()
            except (ConnectionError, http.client.RemoteDisconnected):
                # The server closed the connection while the other modes ran (its
                # keep-alive timeout): connect again; this call's time starts after that.
                conns[mode].close()
                conns[mode].connect()
                began = time.perf_counter()
                conns[mode].request("POST", "/v1/chat/completions", body, headers)
                reply = conns[mode].getresponse()
            data = reply.read()
            if reply.status != 200:
                sys.exit(f"{mode}: HTTP {reply.status}: {data[:300]!r}")
            return (time.perf_counter() - began) * 1000

        for mode in modes:  # warm-up: caches, connections, the workers' first batches
            for _ in range(300):
                call(mode)
        names = {"upstream gateway": "sluice", "echo worker": "worker",
                 "audit writer": "auditwriter", "front gateway": "front",
                 "upstream worker": "upstream worker"}
        if args.worker_from:
            names["upstream worker b"] = "upstream worker b"
        pids = {label: process_tree(group.children[name].proc.pid)
                for label, name in names.items()}
        if private is not None:
            pids["redis (private)"] = [int(redis.Redis.from_url(env["REDIS_URL"])
                                           .info("server")["process_id"])]

        def cpu() -> dict[str, float]:
            return {label: sum(map(cpu_seconds, ps)) for label, ps in pids.items()}

        # Latency: one call of each mode per round, in a shuffled order (the machine's
        # speed changes within seconds; paired calls see the same moments).
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.calls):
            order = list(modes)
            random.shuffle(order)
            for mode in order:
                times[mode].append(call(mode))
        # CPU: blocks of one mode (a process's CPU cannot be split between calls that
        # overlap it), alternating, shuffled per round.
        used: dict[str, dict[str, float]] = {m: dict.fromkeys(pids, 0.0) for m in modes}
        counted = dict.fromkeys(modes, 0)
        for _ in range(max(1, args.calls // args.block)):
            order = list(modes)
            random.shuffle(order)
            for mode in order:
                before = cpu()
                for _ in range(args.block):
                    call(mode)
                after = cpu()
                counted[mode] += args.block
                for label in pids:
                    used[mode][label] += after[label] - before[label]
        for conn in conns.values():
            conn.close()
    n = counted["direct"]
    print(f"latency: {len(times['direct'])} calls per mode, one at a time, the modes "
          f"alternated; CPU: {n} more per mode in blocks of {args.block} (client: Python "
          "http.client, its time included in the latency, its CPU not counted)")
    print(f"{'mode':10} {'p50 ms':>8} {'p90':>8} {'p99':>8} {'mean':>8} {'added p50':>10} "
          f"{'CPU µs/call':>12} {'added CPU':>10}")
    base_p50 = percentile(times["direct"], 0.5)
    base_cpu = sum(used["direct"].values()) / n * 1e6
    figures = {}
    for mode, values in times.items():
        p50 = percentile(values, 0.5)
        cpu_us = sum(used[mode].values()) / n * 1e6
        print(f"{mode:10} {p50:8.3f} {percentile(values, 0.9):8.3f} "
              f"{percentile(values, 0.99):8.3f} {statistics.mean(values):8.3f} "
              f"{p50 - base_p50:+10.3f} {cpu_us:12.0f} {cpu_us - base_cpu:+10.0f}")
        figures[mode] = {"p50_ms": round(p50, 3), "cpu_us": round(cpu_us)}
    print(f"\n{'CPU µs/call by process':24}" + "".join(f"{m:>10}" for m in modes))
    for label in pids:
        print(f"{label:24}" + "".join(f"{used[m][label] / n * 1e6:10.0f}" for m in modes))
    for mode in [m for m in modes if m != "direct"]:
        added = figures[mode]["p50_ms"] - figures["direct"]["p50_ms"]
        print(f"{mode}: p50 {figures[mode]['p50_ms'] / figures['direct']['p50_ms']:.2f}x "
              f"direct, {added:+.3f} ms ({'within' if added <= GOAL_MS else 'over'} the "
              f"{GOAL_MS:g} ms goal); CPU {figures[mode]['cpu_us'] / max(1, base_cpu):.2f}x")
    bench.report("upstream", **{f"{m}_{k}": v for m, f in figures.items() for k, v in f.items()})


if __name__ == "__main__":
    main()
