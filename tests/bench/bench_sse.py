"""Many concurrent SSE streams on one box: errors, added inter-token delay, memory per
stream.

The gateway (--server, default the run command's: uvicorn; --gateways processes, default
the run command's) and one echo worker that batches every stream at once and emits a
token per stream every `--token-ms` (a model's pace; the streams are idle in between).
`--streams` clients (asyncio protocols on uvloop, raw sockets, opened over `--ramp`
seconds) each stream `--tokens` tokens. Reported: streams that failed, the delay between
consecutive tokens beyond the model's own pace (p50/p99, and p99 after the ramp, once no
stream is being opened), the gateway's resident memory (all its processes) per open
stream, and the gateway's and the workers' CPU time per stream (its admission, its
tokens, its end; the steadiest of the figures on a loaded two-core machine, where the
delays swing run to run). The file limit is raised for this process and its children.

    .venv/bin/python tests/bench/bench_sse.py [--streams 10000] [--tokens 10]
        [--token-ms 1000] [--ramp 10] [--server uvicorn|granian|daphne] [--workers 1]
        [--gateways N] [--rounds 1]

With --rounds N the bare fan-out and Sluice alternate N times, each on a fresh server,
and Sluice's own p99 (its p99 less the bare one's, per round) is also given as the
median over the rounds: a single round's swings by 2x or more on these VMs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, cast

import bench_http as bench
import uvloop

from sluice.localinfra import free_port
from sluice.processes import ProcessGroup
from sluice.servers import DEFAULT, SERVERS, default_workers, http_command
from tests.procstat import tree_cpu_seconds, tree_rss_mb


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))] if ordered else float("nan")


class _Stream(asyncio.Protocol):
    """One stream's client side: sends the request, notes each token's arrival time.
    A protocol rather than a StreamReader: a token is one `data_received` and one scan,
    not three awaited `readline`s, so the client (one process for all the streams, on
    the same two cores as the servers) takes less of the machine from what it measures."""

    def __init__(self, request: bytes, tokens: list[float], ended: asyncio.Future[str | None]
                 ) -> None:
        self.request, self.tokens, self.ended = request, tokens, ended
        self.head: bytes | None = b""  # None once the response's head has been read
        self.tail = b""  # an incomplete line

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        if self.head is not None:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            if not self.head.startswith(b"HTTP/1.1 200"):
                return self._end(self.head.split(b"\r\n")[0].decode())
            data, self.head = self.head[end + 4:], None
        lines = (self.tail + data).split(b"\n")
        self.tail = lines.pop()
        for line in lines:
            if line.startswith(b"data: [DONE]"):
                return self._end(None)
            if line.startswith(b"data: ") and b'"content":"' in line \
                    and b'"content":""' not in line:
                self.tokens.append(now)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end("closed early" if exc is None else exc.__class__.__name__)

    def _end(self, outcome: str | None) -> None:
        if not self.ended.done():
            self.ended.set_result(outcome)
        self.transport.close()


async def stream(port: int, request: bytes, tokens: list[float]) -> str | None:
    """One stream; appends each token's arrival time; None, or what went wrong."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[str | None] = loop.create_future()
    try:
        await loop.create_connection(lambda: _Stream(request, tokens, ended),
                                     "127.0.0.1", port)
    except OSError as exc:
        return f"connect: {exc.__class__.__name__}"
    return await ended


async def drive(port: int, key: str, args: argparse.Namespace, gateway_pid: int,
                workers: tuple[int, ...] = ()) -> dict[str, Any]:
    body = (b'{"model": "sse-bench", "stream": true, "max_tokens": %d, "messages": '
            b'[{"role": "user", "content": "%s"}]}' % (args.tokens, b"s" * args.tokens))
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer "
               + key.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)
    arrivals: list[list[float]] = [[] for _ in range(args.streams)]
    before = tree_rss_mb(gateway_pid)
    cpu_before = tree_cpu_seconds(gateway_pid)
    worker_before = sum(map(tree_cpu_seconds, workers))
    tasks = []
    began = time.monotonic()
    for i in range(args.streams):
        tasks.append(asyncio.create_task(stream(port, request, arrivals[i])))
        await asyncio.sleep(max(0.0, began + args.ramp * (i + 1) / args.streams
                                - time.monotonic()))
    peak = tree_rss_mb(gateway_pid)
    opened = time.monotonic()  # the ramp is over: every stream is open
    results = await asyncio.gather(*tasks)
    cpu = tree_cpu_seconds(gateway_pid) - cpu_before
    worker_cpu = sum(map(tree_cpu_seconds, workers)) - worker_before
    gaps = [(b - a) * 1000 - args.token_ms
            for times in arrivals for a, b in itertools.pairwise(times)]
    # Tokens sent once no stream was being opened any more: the fan-out alone, without
    # the admissions of the ramp competing with it for the gateway.
    steady = [(b - a) * 1000 - args.token_ms
              for times in arrivals for a, b in itertools.pairwise(times) if a >= opened]
    errors: dict[str, int] = {}
    for result in results:
        if result is not None:
            errors[result] = errors.get(result, 0) + 1
    return {"streams": args.streams, "errors": errors, "tokens": sum(map(len, arrivals)),
            "added_p50_ms": percentile(gaps, 0.5), "added_p99_ms": percentile(gaps, 0.99),
            "steady_p99_ms": percentile(steady, 0.99),
            "rss_before_mb": before, "rss_open_mb": peak,
            "kb_per_stream": (peak - before) * 1024 / args.streams,
            "cpu_ms_per_stream": cpu * 1000 / args.streams,
            "worker_cpu_ms_per_stream": worker_cpu * 1000 / args.streams if workers else None,
            "seconds": time.monotonic() - began}


def _round(args: argparse.Namespace, env: dict[str, str], key: str) -> dict[str, Any]:
    """One alternation: the bare fan-out, then Sluice, each on a fresh server."""
    results: dict[str, dict[str, Any]] = {}
    group = ProcessGroup({**env, "BARE_SSE_TOKEN_MS": str(args.token_ms)})
    try:
        # The baseline: the same server, client and fan-out with no Sluice (bare_sse.py).
        port = free_port()
        bare = group.start("bare", http_command(args.server, "bare_sse:app", host="127.0.0.1",
                                                port=port, workers=args.gateways,
                                                app_dir=str(bench.REPO / "tests" / "bench")))
        bench.wait_http(f"http://127.0.0.1:{port}/")
        results["bare SSE fan-out"] = uvloop.run(drive(port, key, args, bare.proc.pid))
    finally:
        group.stop()
    group = ProcessGroup(env)
    try:
        port = free_port()
        gateway = group.start("sluice", http_command(args.server, "sluice.root.asgi:application",
                                                     host="127.0.0.1", port=port,
                                                     workers=args.gateways))
        workers = tuple(
            group.start(f"worker-{i}", [sys.executable, str(bench.REPO / "manage.py"),
                                        "runworker", "--deployment", "sse-bench"]).proc.pid
            for i in range(args.workers))
        bench.wait_http(f"http://127.0.0.1:{port}/healthz")
        results["Sluice"] = uvloop.run(drive(port, key, args, gateway.proc.pid, workers))
    finally:
        group.stop(first=bench.FRONT)
    return results


def own(results: dict[str, Any], figure: str) -> float:
    """Sluice's own share of a delay figure: Sluice's less the bare fan-out's."""
    return float(results["Sluice"][figure] - results["bare SSE fan-out"][figure])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--streams", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=10)
    parser.add_argument("--token-ms", type=int, default=1000)
    parser.add_argument("--ramp", type=float, default=10.0)
    parser.add_argument("--server", choices=SERVERS, default=DEFAULT)
    parser.add_argument("--gateways", type=int, default=None,
                        help="gateway processes (default: the run command's, "
                             f"{default_workers()} here under uvicorn)")
    parser.add_argument("--workers", type=int, default=1,
                        help="echo workers; each batches up to streams/workers at once")
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternating bare/Sluice rounds; Sluice's own figures are "
                             "each round's differences and their median")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.gateways = args.gateways or default_workers(args.server)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, args.streams + 4096)  # each side (client, gateway) is one process
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if want < args.streams + 256:
        sys.exit(f"the file limit ({hard}) is too low for {args.streams} streams")
    env, _state, private = bench.bench_env()
    rounds: list[dict[str, Any]] = []
    try:
        key = bench.seed_demo(env)
        deployment = (
            "import django; django.setup(); from inference.models import Deployment; "
            f"Deployment.objects.create(name='sse-bench', runtime='echo', "
            f"max_batch_size={-(-args.streams // args.workers)}, max_wait_ms=50, "
            f"echo_token_delay_ms={args.token_ms}, max_queue_depth={args.streams * 2}, "
            "tenant_queue_share=1.0)")
        subprocess.run([sys.executable, "-c", deployment], cwd=bench.REPO, env=env, check=True)
        print(f"{args.streams} streams x {args.tokens} tokens at {args.token_ms} ms/token, "
              f"{args.server}, {args.gateways} gateway process(es), {args.workers} worker(s)")
        print(f"{'':18} {'failed':>7} {'added p50 ms':>13} {'added p99 ms':>13} "
              f"{'p99 after ramp':>15} {'KB/stream':>10} {'CPU ms/stream':>14} "
              f"{'worker CPU ms/stream':>21}")
        for number in range(1, args.rounds + 1):
            results = _round(args, env, key)
            rounds.append(results)
            if args.rounds > 1:
                print(f"round {number}")
            for label, result in results.items():
                errors = result["errors"]
                print(f"{label:18} {sum(errors.values()):7d} {result['added_p50_ms']:13.1f} "
                      f"{result['added_p99_ms']:13.1f} {result['steady_p99_ms']:15.1f} "
                      f"{result['kb_per_stream']:10.0f} {result['cpu_ms_per_stream']:14.2f} "
                      f"{_ms(result['worker_cpu_ms_per_stream']):>21}")
                if errors:
                    print(f"  {errors}")
            print(f"Sluice's own added inter-token delay over the bare fan-out: p50 "
                  f"{own(results, 'added_p50_ms'):.1f} ms, p99 "
                  f"{own(results, 'added_p99_ms'):.1f} ms (goal: p99 <= 50 ms); p99 after "
                  f"the ramp {own(results, 'steady_p99_ms'):.1f} ms", flush=True)
        p99s = [own(r, "added_p99_ms") for r in rounds]
        if args.rounds > 1:
            steady = [own(r, "steady_p99_ms") for r in rounds]
            print(f"Over {args.rounds} rounds, Sluice's own p99: median "
                  f"{statistics.median(p99s):.1f} ms (rounds: "
                  f"{', '.join(f'{v:.0f}' for v in p99s)}); after the ramp: median "
                  f"{statistics.median(steady):.1f} ms")
        bench.report("sse", streams=args.streams, tokens=args.tokens,
                     gateways=args.gateways, results=rounds[-1],
                     own_p99_ms=p99s, failed=sum(sum(r["Sluice"]["errors"].values())
                                                 for r in rounds))
    finally:
        if private:
            private.stop()


if __name__ == "__main__":
    main()
