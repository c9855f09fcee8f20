"""What observability costs: the governed /v1 pipeline with tracing + logging off and on,
in the same run, alternating so drift hits all sides alike.

    off      SLUICE_TRACING=off (the no-op tracer), text logs at WARNING (no access lines)
    sampled  the production default with a collector: SLUICE_TRACING=auto and an OTLP
             endpoint, so 10% of traces are recorded and exported (the rest still carry
             ids); JSON logs at INFO with the sampled access log written to a file
    full     SLUICE_TRACING=on: every trace recorded and exported (server span, auth,
             limits, breaker, enqueue, wait; the worker's batch spans with links), JSON
             logs as above
Spans go over OTLP/HTTP to a local sink that reads every batch. Prometheus series are
updated in every mode.

Also printed: the cost of one access-log sampling decision and of one recorded span.
The baseline row is a bare ASGI app under the same server in the same run.

    .venv/bin/python tests/bench/bench_telemetry.py [--connections 64] [--seconds 10]
        [--rounds 2]
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import timeit
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform"), str(REPO / "tests" / "bench")]

from bench_http import (  # noqa: E402
    FRONT,
    WRK_LUA,
    bench_env,
    seed_demo,
    start_bare,
    start_sluice,
    wait_http,
    wrk,
    wrk_args,
)

from sluice.localinfra import free_port  # noqa: E402
from sluice.processes import ProcessGroup  # noqa: E402
from sluice.servers import http_command  # noqa: E402

POLICIES = ("import django; django.setup(); from governance.models import Quota, "
            "RateLimitPolicy as R; from tenants.models import Tenant; "
            "t = Tenant.objects.get(slug='demo'); "
            "R.objects.create(scope='tenant', tenant=t, requests_per_minute=10**8, "
            "tokens_per_minute=10**10); Quota.objects.create(tenant=t, max_tokens=10**12)")


class Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that reads and counts what it is sent."""

    received = {"requests": 0, "bytes": 0}

    def do_POST(self) -> None:
        size = int(self.headers.get("content-length") or 0)
        self.rfile.read(size)
        Sink.received["requests"] += 1
        Sink.received["bytes"] += size
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


def micro() -> tuple[float, float]:
    """(ns per sampling decision, us per recorded span with two attributes)."""
    import django

    django.setup()
    from opentelemetry.sdk.trace import TracerProvider

    from sluice.observability.observe import LogSampler

    sampler = LogSampler(per_second=20, slow_s=2.0, critical=("/v1/auth/", "/api/v1/"))
    n = 200_000
    decision = timeit.timeit(lambda: sampler.rate("/v1/chat/completions", 200, 0.003),
                             number=n) / n * 1e9
    tracer = TracerProvider().get_tracer("bench")

    def one_span() -> None:
        with tracer.start_as_current_span("s", attributes={"a": 1, "b": "x"}):
            pass
    m = 20_000
    span = timeit.timeit(one_span, number=m) / m * 1e6
    return decision, span


def main() -> None:
    args = wrk_args(__doc__, rounds=2)
    env, state, private = bench_env()
    sink = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    logs = Path(state) / "sluice.log"
    observed = {**env, "SLUICE_LOG_FORMAT": "json", "SLUICE_LOG_LEVEL": "INFO",
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.server_port}"}
    modes = {
        "off": {**env, "SLUICE_TRACING": "off", "SLUICE_LOG_FORMAT": "text",
                "SLUICE_LOG_LEVEL": "WARNING"},
        "sampled": {**observed, "SLUICE_TRACING": "auto"},
        "full": {**observed, "SLUICE_TRACING": "on"},
    }
    group = ProcessGroup(env)
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in [*modes, "bare"]}
    try:
        key = seed_demo(env)
        subprocess.run([sys.executable, "-c", POLICIES], cwd=REPO, env=env, check=True)
        script = Path(state) / "post.lua"
        script.write_text(WRK_LUA % key)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        bare = start_bare(group, args.server, port)
        wait_http(bare)
        results["bare"].append(wrk(bare, args.connections, args.seconds))
        group.stop()
        for _ in range(args.rounds):
            for mode in modes:
                group = ProcessGroup(modes[mode])
                start_sluice(group, http_command(args.server, "sluice.root.asgi:application",
                                                 host="127.0.0.1", port=port), output=logs)
                wait_http(f"{url}/healthz")
                wrk(f"{url}/v1/chat/completions", 8, 2, str(script))  # warm-up
                results[mode].append(wrk(f"{url}/v1/chat/completions", args.connections,
                                         args.seconds, str(script)))
                group.stop(first=FRONT)  # calls wrk left in flight finish on the worker
        decision_ns, span_us = micro()
    finally:
        group.stop(first=FRONT)
        sink.shutdown()
        if private:
            private.stop()

    def mean(rows: list[dict[str, float]], field: str) -> float:
        return sum(r[field] for r in rows) / len(rows)

    access_lines = sum(1 for line in logs.open() if '"sluice.access"' in line)
    shutil.rmtree(state, ignore_errors=True)
    print(json.dumps({"connections": args.connections, "seconds": args.seconds,
                      "rounds": args.rounds}))
    print(f"{'server':44} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'non-2xx':>8}")
    for label, mode in ((f"bare ASGI ({args.server}, 1 proc)", "bare"),
                        ("sluice governed, tracing+logging off", "off"),
                        ("sluice governed, on (10% traces sampled)", "sampled"),
                        ("sluice governed, on (every trace)", "full")):
        rows = results[mode]
        print(f"{label:44} {mean(rows, 'rps'):9.0f} {mean(rows, 'p50'):8.2f} "
              f"{mean(rows, 'p99'):8.2f} {sum(r['errors'] for r in rows):8.0f}")
    off = mean(results["off"], "rps")
    print("per round (off/sampled/every req/s): " + ", ".join(
        "/".join(f"{r['rps']:.0f}" for r in rows)
        for rows in zip(results["off"], results["sampled"], results["full"], strict=True)))
    for mode, label in (("sampled", "10% sampled"), ("full", "every trace")):
        print(f"observability cost, {label}: {1 - mean(results[mode], 'rps') / off:.1%} of "
              "throughput (goal <= 10%)")
    print(f"sluice off = {off / mean(results['bare'], 'rps'):.1%} of bare ASGI")
    print(f"exported: {Sink.received['requests']} OTLP requests, "
          f"{Sink.received['bytes'] / 1e6:.1f} MB of spans; {access_lines} access lines kept")
    print(f"sampling decision: {decision_ns:.0f} ns; one recorded span: {span_us:.1f} us")


if __name__ == "__main__":
    main()
