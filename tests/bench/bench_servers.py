"""Which ASGI server: daphne, uvicorn and granian on the same apps, same run.

Each server runs one process on loopback; wrk drives it with the same connections and
duration. Two apps: the bare ASGI hello app (what the server itself costs) and Sluice's
/v1/chat/completions against the echo worker (no policies: the pipeline plus the
server), the latter also at one connection (latency at moderate load: "sluice 1c").
The servers take turns within each of --rounds rounds, in a rotated order, and the
table gives each one's median and range: this VM's run-to-run noise is as large as the
differences behind the pipeline, so one run each decides nothing. Each server
must also serve every protocol the run command needs from it: an SSE stream and a
chat over the /v1/chat/socket WebSocket are checked once per server. All three are
dependencies.

    .venv/bin/python tests/bench/bench_servers.py [--rounds 3] [--connections 64] [--seconds 8]
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import sys
from pathlib import Path

import httpx
import websockets

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform"), str(REPO / "tests" / "bench")]

from bench_http import WRK_LUA, bench_env, seed_demo, wait_http, wrk, wrk_args  # noqa: E402

from sluice.localinfra import free_port  # noqa: E402
from sluice.processes import ProcessGroup  # noqa: E402
from sluice.servers import SERVERS, http_command  # noqa: E402

BENCH_DIR = str(REPO / "tests" / "bench")


def servers(app: str, port: int) -> dict[str, list[str]]:
    """The command line of each server for `app` ("module:attr") on `port`."""
    module_dir = BENCH_DIR if app.startswith("bare_asgi") else str(REPO)
    return {name: http_command(name, app, host="127.0.0.1", port=port, app_dir=module_dir)
            for name in SERVERS}


def protocols(url: str, key: str) -> str:
    """"ok" when an SSE chat stream and a chat over the /v1/chat/socket WebSocket both
    complete on the server at `url`; otherwise what failed."""
    auth = {"Authorization": f"Bearer {key}"}
    chat = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", headers=auth, timeout=10,
                          json={**chat, "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        if response.status_code != 200 or lines[-1:] != ["data: [DONE]"]:
            return f"SSE failed: {response.status_code}"

        async def socket() -> str:
            ws_url = url.replace("http://", "ws://") + "/v1/chat/socket"
            async with websockets.connect(ws_url, additional_headers=auth) as ws:
                await ws.send(json.dumps({"type": "chat.request", "id": "r1", "request": chat}))
                while True:
                    frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
                    if frame["type"] == "chat.done":
                        return "ok"
                    if frame["type"] == "error":
                        return f"WebSocket failed: {frame['error']}"

        return asyncio.run(socket())
    except Exception as error:  # the table says which protocol broke
        return f"failed: {type(error).__name__}: {error}"


def main() -> None:
    args = wrk_args(__doc__, seconds=8, rounds=3)
    env, state, private = bench_env()
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    served: dict[str, str] = {}
    group = ProcessGroup(env)
    names = list(SERVERS)
    try:
        key = seed_demo(env)
        script = Path(state) / "post.lua"
        script.write_text(WRK_LUA % key)
        manage = [sys.executable, str(REPO / "manage.py")]
        worker = ProcessGroup(env)
        worker.start("worker", [*manage, "runworker", "--deployment", "echo"],
                     output=Path(state) / "worker.log")
        for round_ in range(args.rounds):
            order = names[round_ % 3:] + names[:round_ % 3]
            for app, label in (("bare_asgi:app", "bare"),
                               ("sluice.root.asgi:application", "sluice")):
                for name in order:
                    port = free_port()
                    group = ProcessGroup(env)
                    group.start(name, servers(app, port)[name],
                                output=Path(state) / f"{name}.log")
                    url = f"http://127.0.0.1:{port}"
                    if label == "bare":
                        wait_http(f"{url}/")
                        result = wrk(f"{url}/", args.connections, args.seconds)
                    else:
                        wait_http(f"{url}/healthz")
                        if name not in served:
                            served[name] = protocols(url, key)
                        target = f"{url}/v1/chat/completions"
                        wrk(target, 8, 2, str(script))  # warm-up
                        result = wrk(target, args.connections, args.seconds, str(script))
                        # Moderate load: one connection, one request at a time.
                        results.setdefault((name, "sluice 1c"), []).append(
                            wrk(target, 1, args.seconds, str(script)))
                    results.setdefault((name, label), []).append(result)
                    group.stop()
        worker.stop()
    finally:
        group.stop()
        if private:
            private.stop()
        shutil.rmtree(state, ignore_errors=True)

    def median(name: str, label: str, field: str) -> float:
        return statistics.median(r[field] for r in results[(name, label)])

    print(json.dumps({"rounds": args.rounds, "connections": args.connections,
                      "seconds": args.seconds}))
    print(f"{'server':10} {'app':8} {'median req/s':>12} {'range':>15} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'non-2xx':>8}  SSE + WebSocket")
    for (name, label), runs in results.items():
        rps = [r["rps"] for r in runs]
        print(f"{name:10} {label:8} {median(name, label, 'rps'):12.0f} "
              f"{f'{min(rps):.0f}-{max(rps):.0f}':>15} {median(name, label, 'p50'):8.2f} "
              f"{median(name, label, 'p99'):8.2f} {sum(r['errors'] for r in runs):8.0f}  "
              f"{served.get(name, '') if label == 'sluice' else ''}")
    for label in ("bare", "sluice"):
        base = median("uvicorn", label, "rps")
        print(f"{label}: " + ", ".join(
            f"{name} {median(name, label, 'rps') / base:.2f}x" for name in
            ("daphne", "granian")) + " of uvicorn's req/s (medians)")
    print("sluice at one connection: p50 " + ", ".join(
        f"{name} {median(name, 'sluice 1c', 'p50'):.2f} ms" for name in SERVERS))


if __name__ == "__main__":
    main()
