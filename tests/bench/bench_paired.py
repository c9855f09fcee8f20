"""Paired latency: an earlier revision's stack and this checkout's, side by side, the
same calls alternated between them.

These VMs change speed by 2-3x within minutes (ab.sh's alternating runs of whole
benchmarks still land in different phases), so a latency change of a few hundred
microseconds only shows when both sides are measured in the same moments. This runs
both stacks at once, each as bench_http.py's governed setup (one uvicorn process, an
echo worker, the audit writer; its own Redis database and state dir): REV's from a git
worktree, this checkout's from here. Then `--calls` rounds of one call to each, in
random order, one at a time (`--gap-ms` of idle before each: moderate load), from one
keep-alive connection per side. It prints each side's p50/p90/p99/mean and the change.
REV must have tests/bench/bench_http.py with `platform()` (2026-12-03 or later).

    .venv/bin/python tests/bench/bench_paired.py REV [--calls 2000] [--gap-ms 0]
    .venv/bin/python tests/bench/bench_paired.py --serve REPO DB   (one side; internal)
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
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
BODY = json.dumps({"model": "echo", "messages": [{"role": "user", "content": "hello"}]})


def serve(repo: str, db: str) -> None:
    """One side: `repo`'s own bench helpers and code; prints {"port", "key"}, then runs
    until stdin closes."""
    os.environ["SLUICE_BENCH_REDIS_URL"] = f"redis://127.0.0.1:6379/{db}"
    path = f"{repo}:{repo}/platform"
    sys.path[:0] = [f"{repo}/tests/bench", repo, f"{repo}/platform"]
    import bench_http as bench  # the side's own

    from sluice.localinfra import free_port
    from sluice.servers import http_command

    with bench.platform(PYTHONPATH=path) as (env, _state, group, _private):
        key = bench.seed_demo(env)
        bench.govern_demo(env)
        port = free_port()
        bench.start_sluice(group, http_command("uvicorn", "sluice.root.asgi:application",
                                               host="127.0.0.1", port=port, workers=1))
        bench.wait_http(f"http://127.0.0.1:{port}/healthz")
        print(json.dumps({"port": port, "key": key}), flush=True)
        sys.stdin.read()


def percentile(values: list[float], p: float) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * p))]


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("rev")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--gap-ms", type=float, default=0.0)
    args = parser.parse_args()
    tree = Path(tempfile.mkdtemp(prefix="sluice-paired-")) / "rev"
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), args.rev],
                   cwd=REPO, check=True)
    sides = {f"{args.rev} (before)": (str(tree), "12"), "checkout (after)": (str(REPO), "13")}
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        info = {}
        for name, (repo, db) in sides.items():
            procs[name] = subprocess.Popen(
                [sys.executable, str(HERE), "--serve", repo, db], cwd=repo, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            line = procs[name].stdout.readline() if procs[name].stdout else ""
            if not line:
                sys.exit(f"{name}: the stack did not start")
            info[name] = json.loads(line)
        conns = {n: http.client.HTTPConnection("127.0.0.1", i["port"]) for n, i in info.items()}

        def call(name: str) -> float:
            began = time.perf_counter()
            conns[name].request("POST", "/v1/chat/completions", BODY, {
                "Content-Type": "application/json",
                "Authorization": f"Bearer {info[name]['key']}"})
            reply = conns[name].getresponse()
            reply.read()
            if reply.status != 200:
                sys.exit(f"{name}: HTTP {reply.status}")
            return (time.perf_counter() - began) * 1000

        for name in conns:  # warm-up: caches, connections, the worker's first batches
            for _ in range(300):
                call(name)
        times: dict[str, list[float]] = {name: [] for name in conns}
        for _ in range(args.calls):
            order = list(conns)
            random.shuffle(order)
            for name in order:
                if args.gap_ms:
                    time.sleep(args.gap_ms / 1000)
                times[name].append(call(name))
        print(f"{args.calls} calls each, one at a time, {args.gap_ms:g} ms idle before each "
              "(client: Python http.client, included)")
        for name, values in times.items():
            print(f"{name:24} p50 {percentile(values, 0.5):7.3f}  p90 "
                  f"{percentile(values, 0.9):7.3f}  p99 {percentile(values, 0.99):7.3f}  "
                  f"mean {statistics.mean(values):7.3f} ms")
        before, after = times.values()
        print(f"change: p50 {percentile(after, 0.5) - percentile(before, 0.5):+.3f} ms "
              f"({percentile(after, 0.5) / percentile(before, 0.5) - 1:+.0%}), mean "
              f"{statistics.mean(after) - statistics.mean(before):+.3f} ms")
    finally:
        for proc in procs.values():
            if proc.stdin:
                proc.stdin.close()
            proc.wait(60)
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO,
                       check=False)


if __name__ == "__main__":
    main()
