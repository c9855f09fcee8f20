"""Which ASGI server: daphne, uvicorn and granian on the same apps, same run.

Each server runs one process on loopback; wrk drives it with the same connections and
duration. Two apps: the bare ASGI hello app (what the server itself costs) and Sluice's
/v1/chat/completions against the echo worker (no policies: the pipeline plus the
server). granian is installed into the virtualenv on first use (a benchmark-only tool,
not a project dependency); daphne and uvicorn are dependencies.

    .venv/bin/python tests/bench/bench_servers.py [--connections 64] [--seconds 8]
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform"), str(REPO / "tests" / "bench")]

from bench_http import WRK_LUA, bench_env, seed_demo, wait_http, wrk, wrk_args  # noqa: E402

from sluice.localinfra import free_port  # noqa: E402
from sluice.processes import ProcessGroup  # noqa: E402

BENCH_DIR = str(REPO / "tests" / "bench")


def servers(app: str, port: int) -> dict[str, list[str]]:
    """The command line of each server for `app` ("module:attr") on `port`."""
    py = sys.executable
    module_dir = BENCH_DIR if app.startswith("bare_asgi") else str(REPO)
    return {
        "uvicorn": [py, "-m", "uvicorn", "--app-dir", module_dir, "--host", "127.0.0.1",
                    "--port", str(port), "--workers", "1", "--no-access-log",
                    "--log-level", "warning", "--lifespan", "on", app],
        "daphne": [py, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "-v", "0", app],
        "granian": [py, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1",
                    "--port", str(port), "--workers", "1", "--log-level", "warning",
                    "--working-dir", module_dir, app],
    }


def main() -> None:
    args = wrk_args(__doc__, seconds=8)
    if importlib.util.find_spec("granian") is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "granian"], check=True)
    env, state, private = bench_env()
    env["PYTHONPATH"] = f"{BENCH_DIR}:{REPO}:{REPO / 'platform'}"
    results: dict[tuple[str, str], dict[str, float]] = {}
    group = ProcessGroup(env)
    try:
        key = seed_demo(env)
        script = Path(state) / "post.lua"
        script.write_text(WRK_LUA % key)
        manage = [sys.executable, str(REPO / "manage.py")]
        worker = ProcessGroup(env)
        worker.start("worker", [*manage, "runworker", "--deployment", "echo"],
                     output=Path(state) / "worker.log")
        for app, label in (("bare_asgi:app", "bare"), ("sluice.asgi:application", "sluice")):
            for name, argv in servers(app, port := free_port()).items():
                group = ProcessGroup(env)
                group.start(name, argv, output=Path(state) / f"{name}.log")
                url = f"http://127.0.0.1:{port}"
                if label == "bare":
                    wait_http(f"{url}/")
                    results[(name, label)] = wrk(f"{url}/", args.connections, args.seconds)
                else:
                    wait_http(f"{url}/healthz")
                    target = f"{url}/v1/chat/completions"
                    wrk(target, 8, 2, str(script))  # warm-up
                    results[(name, label)] = wrk(target, args.connections, args.seconds,
                                                 str(script))
                group.stop()
        worker.stop()
    finally:
        group.stop()
        if private:
            private.stop()
        shutil.rmtree(state, ignore_errors=True)
    print(f"{'server':10} {'app':8} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'non-2xx':>8}")
    for (name, label), r in results.items():
        print(f"{name:10} {label:8} {r['rps']:9.0f} {r['p50']:8.2f} {r['p99']:8.2f} "
              f"{r['errors']:8.0f}")
    for label in ("bare", "sluice"):
        base = results[("uvicorn", label)]["rps"]
        print(f"{label}: " + ", ".join(
            f"{name} {results[(name, label)]['rps'] / base:.2f}x" for name in
            ("daphne", "granian")) + " of uvicorn")


if __name__ == "__main__":
    main()
