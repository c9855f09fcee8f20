"""The ASGI servers Sluice's HTTP side runs under, as command lines: one place for the
run command and the benchmarks.

uvicorn (httptools, uvloop) is the default. In tests/bench/bench_servers.py (interleaved
rounds; docs/BENCHMARKS.md, "ASGI server choice") granian serves a bare app
faster, but behind Sluice's pipeline the two are even at 64 connections, uvicorn answers
a lone request sooner (p50 0.4-2 ms less) and holds an idle SSE stream in about half
the memory; granian keeps a lower p99 when one process fans out to 10,000 SSE streams,
so it stays selectable (`--server granian`). daphne keeps working (the card's server;
~0.2x bare, ~0.7x behind the pipeline).

The run command serves HTTP with one process per core, up to MAX_DEFAULT_WORKERS
(`default_workers`). On two cores, one gateway process left half a core idle at 64
connections: it ran ~70% of a core and slept the rest while its calls were with Redis,
the model worker or the audit writer, which run as processes of their own. Two kept the
cores busy and served 37-47% more governed calls at a 30% lower p50, with less CPU per
call (`tests/bench/bench_cpu.py --workers 1|2`, alternating; docs/BENCHMARKS.md,
"CPU per call, by process"). Larger machines were not measured: the cap keeps cores for the model
workers.

TLS and HTTP/2 (docs/TLS.md): granian is the one of the three that speaks HTTP/2 (h2 by
ALPN beside http/1.1 over TLS, h2c by prior knowledge beside HTTP/1.1 without), so the
run command picks it (`choose`) when a certificate is configured or HTTP/2 only is asked
for; uvicorn serves TLS with HTTP/1.1 only, daphne no TLS here. In
tests/bench/bench_http2.py (docs/BENCHMARKS.md, "HTTP/2 and TLS on the edge") granian's
HTTP/1.1 also out-served uvicorn's at 50-2,000 clients (1.1-2.3x req/s, two runs on a
loaded VM), but the lone-request latency and SSE memory behind the default were not
measured there, so plain HTTP/1.1 keeps uvicorn.

Forwarded headers (X-Forwarded-For, X-Forwarded-Proto) are believed only from
SLUICE_TRUSTED_PROXIES (`trusted_proxies`; none by default), the same rule as
tenants.throttle.client_source. uvicorn would otherwise believe them from 127.0.0.1, so
it is told the list, or `--no-proxy-headers` when it is empty. daphne's
`--proxy-headers` believes any peer and takes the left-most hop, which the client
writes, so it is never passed: the application reads X-Forwarded-For itself under the
rule. granian's command line rewrites nothing."""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SERVERS = ("uvicorn", "granian", "daphne")
DEFAULT = "uvicorn"

# WebSocket keepalive (a /v1/realtime socket lives for hours, and proxies close idle
# connections): uvicorn pings every socket idle for 20 s and closes one that leaves a
# ping unanswered 20 s (its defaults, --ws-ping-interval/--ws-ping-timeout); daphne pings
# every 20 s (timeout 30 s) and caps a socket at 24 h (--websocket_timeout); granian 2.8
# has no WebSocket ping, so its clients behind such a proxy must ping themselves.

# granian admits at most `backpressure` requests at once per worker (default
# backlog/workers = 1024) and queues the rest: an SSE stream is a request for its
# whole life, so the cap is set far above the concurrent streams one process serves.
GRANIAN_MAX_CONCURRENT = 65536
MAX_DEFAULT_WORKERS = 4
HTTP_VERSIONS = ("auto", "1", "2")
# Streams one HTTP/2 connection may carry at once (granian's default is 200): as many as
# the gRPC server allows, so a proxy multiplexing SSE streams opens as few connections.
H2_MAX_STREAMS = 1000


@dataclass(frozen=True)
class Tls:
    """A certificate chain and its private key, PEM files (PKCS#8, PKCS#1 or SEC1)."""

    cert_file: str
    key_file: str

    def check(self) -> None:
        """ValueError naming the file that cannot be read (before a server fails on it)."""
        for what, path in (("certificate", self.cert_file), ("key", self.key_file)):
            try:
                with Path(path).open("rb") as handle:
                    if b"-----BEGIN " not in handle.read(64 * 1024):
                        raise ValueError(f"TLS {what} file {path} is not PEM")
            except OSError as exc:
                raise ValueError(f"TLS {what} file {path}: {exc.strerror}") from None


def choose(server: str | None, *, tls: bool, http: str = "auto") -> str:
    """The server the run command starts: `server` when one is named, else granian
    when HTTP/2 is wanted (a certificate under `http` auto, or `http` "2"), else
    DEFAULT."""
    if server:
        return server
    return "granian" if http == "2" or (tls and http == "auto") else DEFAULT


def default_workers(server: str = DEFAULT) -> int:
    """How many HTTP processes the run command starts under `server`:
    SLUICE_HTTP_WORKERS when set, else one per core up to MAX_DEFAULT_WORKERS (daphne:
    one, all it runs)."""
    configured = os.environ.get("SLUICE_HTTP_WORKERS", "").strip()
    if configured:
        return int(configured)
    if server == "daphne":
        return 1
    return max(1, min(MAX_DEFAULT_WORKERS, os.cpu_count() or 1))


def proxy_options(trusted_proxies: Sequence[str] | None = None) -> list[str]:
    """uvicorn's options for forwarded headers: believed from `trusted_proxies` (CIDRs;
    None: settings.SLUICE_TRUSTED_PROXIES) only, from no one when there are none."""
    if trusted_proxies is None:
        from django.conf import settings

        trusted_proxies = settings.SLUICE_TRUSTED_PROXIES
    if not trusted_proxies:
        return ["--no-proxy-headers"]
    # uvicorn reads "10.0.0.1/8" (host bits set) as a literal name, never an address.
    networks = [str(ipaddress.ip_network(cidr.strip(), strict=False))
                for cidr in trusted_proxies]
    return ["--proxy-headers", "--forwarded-allow-ips", ",".join(networks)]


def http_command(server: str, app: str, *, host: str, port: int, workers: int = 1,
                 app_dir: str | None = None, graceful_s: int = 5, tls: Tls | None = None,
                 http: str = "auto", trusted_proxies: Sequence[str] | None = None
                 ) -> list[str]:
    """The command line that serves ASGI `app` ("module:attr") with `server` on
    host:port with `workers` processes, lifespan on, no access log (Sluice writes its
    own), logs at warning and up; `app_dir` goes first on the import path. With `tls`,
    TLS 1.2 and 1.3 (1.3 preferred); `http` is one of HTTP_VERSIONS. ValueError for a
    combination the server cannot serve (HTTP/2 on uvicorn or daphne, TLS on daphne).
    Forwarded headers are believed from `trusted_proxies` only (None: the setting;
    see the module's doc)."""
    if http not in HTTP_VERSIONS:
        raise ValueError(f"HTTP version {http!r}: one of {', '.join(HTTP_VERSIONS)}")
    if http == "2" and server != "granian":
        raise ValueError(f"{server} speaks HTTP/1.1 only; HTTP/2 needs granian")
    py = sys.executable
    if server == "granian":
        secure = (["--ssl-certificate", tls.cert_file, "--ssl-keyfile", tls.key_file,
                   "--ssl-protocol-min", "tls1.2"] if tls else [])
        return [py, "-m", "granian", "--interface", "asgi", "--host", host, "--port",
                str(port), "--workers", str(workers), "--log-level", "warning",
                "--backlog", "4096", "--backpressure", str(GRANIAN_MAX_CONCURRENT),
                "--workers-kill-timeout", str(graceful_s), "--http", http,
                "--http2-max-concurrent-streams", str(H2_MAX_STREAMS), *secure,
                *(["--working-dir", app_dir] if app_dir else []), app]
    if server == "uvicorn":
        # Python's default context: TLS 1.2 minimum, 1.3 preferred.
        secure = ["--ssl-certfile", tls.cert_file, "--ssl-keyfile", tls.key_file] if tls else []
        return [py, "-m", "uvicorn", "--host", host, "--port", str(port), "--workers",
                str(workers), "--no-access-log", "--log-level", "warning", "--lifespan",
                "on", "--timeout-graceful-shutdown", str(graceful_s), *secure,
                *proxy_options(trusted_proxies),
                *(["--app-dir", app_dir] if app_dir else []), app]
    if server == "daphne":
        if tls:
            raise ValueError("daphne is not given TLS here: use granian or uvicorn, or a "
                             "proxy in front")
        if workers != 1:
            raise ValueError("daphne runs one process; put several behind a balancer")
        # daphne has no --app-dir: its entry point is called after the path is set.
        start = (["-c", f"import sys; sys.path.insert(0, {app_dir!r}); from daphne.cli "
                        "import CommandLineInterface as C; C.entrypoint()"]
                 if app_dir else ["-m", "daphne"])
        return [py, *start, "-b", host, "-p", str(port), "-v", "0", app]
    raise ValueError(f"unknown server {server!r}; one of {', '.join(SERVERS)}")
