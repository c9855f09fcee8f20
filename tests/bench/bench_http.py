"""Requests/s of Sluice's OpenAI path against a bare ASGI app, same server, same run.

Both run under the same ASGI server (--server, default the run command's: uvicorn) with
the same number of processes (--workers, default the run command's: one per core, up to
4) on loopback; wrk (Debian package `wrk`) drives them with the same
connections and duration. Sluice's side is the full path a client takes today: bearer
API key (cached), model lookup (cached), governance admission, enqueue on Redis, one
echo worker (no model compute), events back, settlement, JSON response; the audit
writer process moves the audit events into the database meanwhile.
It is measured twice: with no policies (breaker and shedding checks only), and
"governed": a tenant rate limit, a per-model rate limit and a daily token quota (limits
far above what the run reaches), so every request runs the bucket and quota scripts.

    .venv/bin/python tests/bench/bench_http.py [--connections 64] [--seconds 10]
        [--server uvicorn|granian|daphne] [--workers N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

import redis  # noqa: E402

from sluice.localinfra import ensure_redis, free_port  # noqa: E402
from sluice.processes import ProcessGroup  # noqa: E402
from sluice.servers import DEFAULT, SERVERS, default_workers, http_command  # noqa: E402

WRK_LUA = """
wrk.method = "POST"
wrk.body = '{"model": "echo", "messages": [{"role": "user", "content": "hello"}]}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %s"
"""


def report(bench: str, **figures: Any) -> None:
    """A benchmark's headline figures for tests/bench/suite.py: one JSON line appended to
    the file SLUICE_BENCH_REPORT names (nothing when it is unset)."""
    path = os.environ.get("SLUICE_BENCH_REPORT")
    if path:
        with Path(path).open("a") as out:
            out.write(json.dumps({"bench": bench, **figures}) + "\n")


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


def wrk(url: str, connections: int, seconds: int, script: str | None = None) -> dict[str, float]:
    cmd = ["wrk", f"-t{min(2, connections)}", f"-c{connections}", f"-d{seconds}s", "--latency", url]
    if script:
        cmd[1:1] = ["-s", script]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)

    def pct(p: str) -> float:
        m = re.search(rf"\s{p}%\s+([\d.]+)(us|ms|s)", out)
        if not m:
            return float("nan")
        return float(m.group(1)) * {"us": 0.001, "ms": 1, "s": 1000}[m.group(2)]

    return {"rps": rps, "p50": pct("50"), "p99": pct("99"),
            "errors": float(errors.group(1)) if errors else 0.0}


def bench_env() -> tuple[dict[str, str], str, Any]:
    """(environment, state dir, private Redis or None) for a throwaway platform: SQLite
    in a temporary state dir (the run command's default), and the benchmarks' own Redis
    database (SLUICE_BENCH_REDIS_URL, default database 11), emptied first: nothing an
    earlier run left queued may skew this one."""
    state = tempfile.mkdtemp(prefix="sluice-bench-")
    redis_url, private = ensure_redis(os.environ.get("SLUICE_BENCH_REDIS_URL",
                                                     "redis://127.0.0.1:6379/11"))
    redis.Redis.from_url(redis_url).flushdb()
    env = {**os.environ, "SLUICE_STATE_DIR": state, "REDIS_URL": redis_url,
           "DJANGO_SETTINGS_MODULE": "sluice.settings.base", "SLUICE_LOG_LEVEL": "WARNING"}
    env.pop("DATABASE_URL", None)
    return env, state, private


def seed_demo(env: dict[str, str]) -> str:
    """Migrate, seed the demo tenant and the shipped deployments; the demo API key."""
    seed = ("import django; django.setup(); from django.core.management import "
            "call_command; call_command('migrate', verbosity=0); from tenants.services "
            "import demo_seed; from inference.services import deployment_seed_defaults; "
            "deployment_seed_defaults(); print(demo_seed().api_key)")
    return subprocess.run([sys.executable, "-c", seed], cwd=REPO, env=env, check=True,
                          capture_output=True, text=True).stdout.strip().splitlines()[-1]


def govern_demo(env: dict[str, str]) -> None:
    """Policies on the demo tenant that every call runs but none reaches: a tenant rate
    limit (requests and tokens), an adaptive per-model limit, a daily token quota."""
    policies = ("import django; django.setup(); from governance.models import Quota, "
                "RateLimitPolicy as R; from tenants.models import Tenant; "
                "t = Tenant.objects.get(slug='demo'); "
                "R.objects.create(scope='tenant', tenant=t, requests_per_minute=10**8, "
                "tokens_per_minute=10**10); R.objects.create(scope='model', tenant=t, "
                "requests_per_minute=10**8, adaptive=True, qps_ref=1); "
                "Quota.objects.create(tenant=t, max_tokens=10**12)")
    subprocess.run([sys.executable, "-c", policies], cwd=REPO, env=env, check=True)


# Stopped before the rest (ProcessGroup.stop(first=...)), as the run command does: the
# calls a load generator left in flight finish instead of waiting on a stopped worker
# (and the gateway logging their cancellation at its graceful timeout).
FRONT = ("sluice", "grpc")


@contextlib.contextmanager
def platform(**extra_env: str) -> Iterator[tuple[dict[str, str], str, ProcessGroup, Any]]:
    """`bench_env()` (plus `extra_env`) and a process group on it: (environment, state
    dir, group, private Redis or None). At the end the group is stopped, servers first,
    and a private Redis with it."""
    env, state, private = bench_env()
    env.update(extra_env)
    group = ProcessGroup(env)
    try:
        yield env, state, group, private
    finally:
        group.stop(first=FRONT)
        if private:
            private.stop()


def start_bare(group: ProcessGroup, server: str, port: int, *, workers: int = 1) -> str:
    """The bare ASGI hello app (tests/bench/bare_asgi.py) under `server` with `workers`
    processes, named "bare" in the group; its URL."""
    group.start("bare", http_command(server, "bare_asgi:app", host="127.0.0.1", port=port,
                                     workers=workers, app_dir=str(REPO / "tests" / "bench")))
    return f"http://127.0.0.1:{port}/"


def start_sluice(group: ProcessGroup, http: list[str], *, audit: bool = True,
                 output: Path | None = None,
                 prefix: Callable[[str], list[str]] = lambda name: []) -> None:
    """The gateway (`http`: its server command), an echo worker, and the audit writer;
    their output goes to `output` when given; `prefix(name)` goes before a process's
    command (a profiler's)."""
    manage = [sys.executable, str(REPO / "manage.py")]
    group.start("sluice", [*prefix("sluice"), *http], output=output)
    group.start("worker", [*prefix("worker"), *manage, "runworker", "--deployment", "echo"],
                output=output)
    if audit:
        group.start("auditwriter", [*prefix("auditwriter"), *manage, "auditwriter"],
                    output=output)


def wrk_args(doc: str, *, seconds: int = 10, rounds: int | None = None,
             workers: bool = False,
             extra: Callable[[argparse.ArgumentParser], object] | None = None
             ) -> argparse.Namespace:
    """The options every wrk benchmark takes (--connections, --seconds, --server,
    --rounds where it alternates modes, --workers where it chooses the HTTP processes),
    plus those `extra` adds; exits with a hint when wrk is missing."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    if extra is not None:
        extra(parser)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--server", choices=SERVERS, default=DEFAULT,
                        help=f"ASGI server (default {DEFAULT}, the run command's)")
    parser.add_argument("--seconds", type=int, default=seconds)
    if rounds is not None:
        parser.add_argument("--rounds", type=int, default=rounds)
    if workers:
        parser.add_argument("--workers", type=int, default=None,
                            help="HTTP processes (default: the run command's, "
                                 f"{default_workers()} here under uvicorn)")
    args = parser.parse_args()
    if workers and args.workers is None:
        args.workers = default_workers(args.server)
    if shutil.which("wrk") is None:
        sys.exit("wrk is needed: apt-get install wrk")
    return args


def main() -> None:
    args = wrk_args(__doc__, workers=True)
    env, state, private = bench_env()
    group = ProcessGroup(env)
    try:
        key = seed_demo(env)
        bare_port, sluice_port = free_port(), free_port()
        start_bare(group, args.server, bare_port, workers=args.workers)
        sluice = http_command(args.server, "sluice.root.asgi:application", host="127.0.0.1",
                              port=sluice_port, workers=args.workers)
        start_sluice(group, sluice, audit=False)
        wait_http(f"http://127.0.0.1:{bare_port}/")
        wait_http(f"http://127.0.0.1:{sluice_port}/healthz")
        script = Path(state) / "post.lua"
        script.write_text(WRK_LUA % key)
        # warm-up: caches, connections, the worker's first batch
        wrk(f"http://127.0.0.1:{sluice_port}/v1/chat/completions", 8, 2, str(script))
        bare = wrk(f"http://127.0.0.1:{bare_port}/", args.connections, args.seconds)
        # Moderate load: one connection, one request at a time (the added latency).
        bare_one = wrk(f"http://127.0.0.1:{bare_port}/", 1, args.seconds)
        group.stop()  # the bare server's core goes back to the pipeline
        group = ProcessGroup(env)
        start_sluice(group, sluice)
        wait_http(f"http://127.0.0.1:{sluice_port}/healthz")
        wrk(f"http://127.0.0.1:{sluice_port}/v1/chat/completions", 8, 2, str(script))
        full = wrk(f"http://127.0.0.1:{sluice_port}/v1/chat/completions", args.connections,
                   args.seconds, str(script))
        govern_demo(env)
        group.stop(first=FRONT)  # a fresh process: no cached "no policies" for the demo
        group = ProcessGroup(env)
        start_sluice(group, sluice)
        wait_http(f"http://127.0.0.1:{sluice_port}/healthz")
        wrk(f"http://127.0.0.1:{sluice_port}/v1/chat/completions", 8, 2, str(script))
        governed = wrk(f"http://127.0.0.1:{sluice_port}/v1/chat/completions",
                       args.connections, args.seconds, str(script))
        governed_one = wrk(f"http://127.0.0.1:{sluice_port}/v1/chat/completions", 1,
                           args.seconds, str(script))
        print(json.dumps({"server": args.server, "workers": args.workers,
                          "connections": args.connections, "seconds": args.seconds}))
        print(f"{'server':34} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'non-2xx':>8}")
        rows = [(f"bare ASGI ({args.server}, {args.workers} proc)", bare),
                ("sluice /v1/chat, no policies", full),
                ("sluice /v1/chat, governed", governed),
                ("bare ASGI, 1 connection", bare_one),
                ("sluice governed, 1 connection", governed_one)]
        for label, r in rows:
            print(f"{label:34} {r['rps']:9.0f} {r['p50']:8.2f} {r['p99']:8.2f} "
                  f"{r['errors']:8.0f}")
        print(f"ratio: {full['rps'] / bare['rps']:.1%} of bare ASGI without policies, "
              f"{governed['rps'] / bare['rps']:.1%} governed "
              f"(governance costs {1 - governed['rps'] / full['rps']:.0%})")
        print(f"added p50 at one connection (governed pipeline, echo worker included): "
              f"{governed_one['p50'] - bare_one['p50']:.2f} ms")
        report("rest", workers=args.workers, bare=bare, no_policies=full, governed=governed,
               bare_one=bare_one, governed_one=governed_one)
    finally:
        group.stop(first=FRONT)
        if private:
            private.stop()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
