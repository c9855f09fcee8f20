"""HTTP/1.1 against HTTP/2 on Sluice's pipeline, and a full TLS 1.3 handshake against a
resumed one, in one run.

The edge is what the run command starts for TLS (servers.choose: granian, one process
per core, HTTP version auto) serving /v1/chat/completions against one echo worker (no
policies), with the audit writer running. h2load (Debian package `nghttp2-client`) sends
a fixed number of requests at each level of concurrent clients (--levels, default 50,
500 and 2,000), one request in flight per client, in each mode:
  h1 TLS      HTTP/1.1 over TLS (ALPN http/1.1), a connection per client: the baseline
  h2 TLS      HTTP/2 over TLS (ALPN h2), a connection per client
  h2 TLS mux  HTTP/2 over TLS, the same clients as streams, 50 to a connection (what a
              proxy in front or a pooled SDK client does)
  h1 / h2c    the same server without TLS: HTTP/1.1, and h2c by prior knowledge
  uvicorn h1  the run command's server without TLS (today's default), for reference
At each level the modes take turns in a rotated order.
p50/p99 come from h2load's per-request log (request sent to response ended); req/s is
h2load's, connection set-up included. Ratios are against h1 TLS at the same level.

Handshakes: ssl-module clients (TLS 1.3, ALPN h2 and http/1.1) open --handshakes
connections each way, each closed once the server's session ticket is in: full
handshakes (no session), and resumed ones (each offering the ticket the previous
connection got; a ticket is single-use). Time is connect-to-handshake-done; client CPU
is the thread's around the handshake; server CPU is the edge's per connection (the
handshake and its tickets, no request). They run against a one-process TLS edge: each
granian process keeps its own session cache, so against several a ticket resumes only on
the process that issued it; that rate is measured on the multi-process edge too.

    .venv/bin/python tests/bench/bench_http2.py [--requests 10000] [--levels 50,500,2000]
        [--handshakes 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import select
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform"), str(REPO / "tests" / "bench")]

from bench_http import FRONT, bench_env, report, seed_demo  # noqa: E402
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from sluice.localinfra import free_port  # noqa: E402
from sluice.processes import ProcessGroup  # noqa: E402
from sluice.servers import Tls, choose, default_workers, http_command  # noqa: E402
from tests.procstat import tree_cpu_seconds  # noqa: E402

GET = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
TICKET_WAIT_S = 5.0


def self_signed(folder: Path) -> Tls:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]),
                           critical=False).sign(key, hashes.SHA256()))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return Tls(str(folder / "cert.pem"), str(folder / "key.pem"))


def wait_up(port: int, context: ssl.SSLContext | None, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if b" 200 " in get_once(port, context):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"port {port} did not answer /healthz")


def get_once(port: int, context: ssl.SSLContext | None) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        sock = context.wrap_socket(raw, server_hostname="localhost") if context else raw
        sock.sendall(GET)
        return sock.recv(65536)


def h2load(url: str, clients: int, requests: int, key: str, body: Path, log: Path, *,
           h1: bool = False, streams: int = 1) -> dict[str, float]:
    """One h2load run: req/s, p50/p99 ms, and the requests not answered 2xx."""
    connections = max(1, clients // streams)
    cmd = ["h2load", "-t1", f"-c{connections}", f"-m{streams}", f"-n{requests}",
           "-d", str(body), "-H", "Content-Type: application/json",
           "-H", f"Authorization: Bearer {key}", f"--log-file={log}", url,
           *(["--h1"] if h1 else [])]
    log.unlink(missing_ok=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         timeout=600).stdout
    rps = float(re.search(r"finished in [\d.]+m?s, ([\d.]+) req/s", out).group(1))  # type: ignore[union-attr]
    ok = int(re.search(r"status codes: (\d+) 2xx", out).group(1))  # type: ignore[union-attr]
    times = sorted(int(row.split("\t")[2]) / 1000 for row in log.read_text().splitlines()
                   if row.split("\t")[1].startswith("2"))
    if not times:
        raise RuntimeError(f"no request answered:\n{out}")
    return {"rps": rps, "p50": times[len(times) // 2],
            "p99": times[min(len(times) - 1, int(len(times) * 0.99))],
            "failed": float(requests - ok)}


def ticket(sock: ssl.SSLSocket, offered: ssl.SSLSession | None) -> ssl.SSLSession:
    """The session with a new ticket (not the `offered` one) that the server sends after
    a TLS 1.3 handshake, read without sending a request: the socket is non-blocking, so a
    read takes in what the server sent and stops."""
    def fresh(session: ssl.SSLSession | None) -> bool:
        return (session is not None and session.has_ticket
                and (offered is None or session.id != offered.id))

    sock.setblocking(False)
    deadline = time.monotonic() + TICKET_WAIT_S
    while not fresh(sock.session):
        if time.monotonic() > deadline:
            raise RuntimeError("no session ticket from the server")
        select.select([sock], [], [], 0.5)
        with contextlib.suppress(ssl.SSLWantReadError):
            sock.recv(1)
    assert sock.session is not None
    return sock.session


def handshakes(port: int, cafile: str, count: int, pids: list[int], *,
               resume: bool) -> dict[str, float]:
    """`count` new TLS connections: handshake ms (p50), client and server CPU per
    connection, and how many were resumed."""
    context = ssl.create_default_context(cafile=cafile)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.set_alpn_protocols(["h2", "http/1.1"])
    session: ssl.SSLSession | None = None
    walls, client_cpu, reused = [], 0.0, 0
    server_before = sum(tree_cpu_seconds(pid) for pid in pids)
    for _ in range(count):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            started, cpu = time.perf_counter(), time.thread_time()
            sock = context.wrap_socket(raw, server_hostname="localhost",
                                       session=session if resume else None)
            client_cpu += time.thread_time() - cpu
            walls.append((time.perf_counter() - started) * 1000)
            reused += sock.session_reused
            session = ticket(sock, session if resume else None)
            sock.close()
    server = sum(tree_cpu_seconds(pid) for pid in pids) - server_before
    return {"ms_p50": statistics.median(walls), "client_cpu_ms": client_cpu / count * 1000,
            "server_cpu_ms": server / count * 1000, "resumed": reused / count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10000,
                        help="requests per run (at least 2 per client)")
    parser.add_argument("--levels", default="50,500,2000")
    parser.add_argument("--handshakes", type=int, default=2000)
    args = parser.parse_args()
    if shutil.which("h2load") is None:
        sys.exit("h2load is needed: apt-get install nghttp2-client")
    levels = [int(n) for n in args.levels.split(",")]
    env, state, private = bench_env()
    folder = Path(tempfile.mkdtemp(prefix="sluice-h2-"))
    group = ProcessGroup(env)
    try:
        key = seed_demo(env)
        tls = self_signed(folder)
        body = folder / "body.json"
        body.write_text(json.dumps({"model": "echo", "messages": [
            {"role": "user", "content": "hello"}]}))
        server = choose(None, tls=True)
        workers = default_workers(server)
        ports = {"tls": free_port(), "clear": free_port(), "uvicorn": free_port(),
                 "tls1": free_port()}
        app = "sluice.root.asgi:application"
        group.start("sluice", http_command(server, app, host="127.0.0.1", port=ports["tls"],
                                           workers=workers, tls=tls))
        group.start("clear", http_command(server, app, host="127.0.0.1", workers=workers,
                                          port=ports["clear"]))
        group.start("uvicorn", http_command("uvicorn", app, host="127.0.0.1", workers=workers,
                                            port=ports["uvicorn"]))
        group.start("tls1", http_command(server, app, host="127.0.0.1", workers=1,
                                         port=ports["tls1"], tls=tls))
        manage = [sys.executable, str(REPO / "manage.py")]
        group.start("worker", [*manage, "runworker", "--deployment", "echo"])
        group.start("auditwriter", [*manage, "auditwriter"])
        trusted = ssl.create_default_context(cafile=tls.cert_file)
        wait_up(ports["tls"], trusted)
        wait_up(ports["clear"], None)
        wait_up(ports["uvicorn"], None)
        wait_up(ports["tls1"], trusted)
        path = "/v1/chat/completions"
        tls_url = f"https://127.0.0.1:{ports['tls']}{path}"
        clear_url = f"http://127.0.0.1:{ports['clear']}{path}"
        modes: dict[str, dict[str, Any]] = {
            "h1 TLS": {"url": tls_url, "h1": True},
            "h2 TLS": {"url": tls_url},
            "h2 TLS mux": {"url": tls_url, "streams": 50},
            "h1": {"url": clear_url, "h1": True},
            "h2c": {"url": clear_url},
            "uvicorn h1": {"url": f"http://127.0.0.1:{ports['uvicorn']}{path}", "h1": True},
        }
        log = folder / "requests.log"
        for mode in modes.values():  # warm-up: caches, connections, the worker's batches
            h2load(mode["url"], 50, 500, key, body, log, h1=mode.get("h1", False))
        results: dict[tuple[int, str], dict[str, float]] = {}
        names = list(modes)
        for turn, level in enumerate(levels):
            # the modes take turns in a rotated order: none always runs first
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                mode = modes[name]
                results[(level, name)] = h2load(
                    mode["url"], level, max(args.requests, 2 * level), key, body, log,
                    h1=mode.get("h1", False), streams=min(level, mode.get("streams", 1)))
        pids = [group.children["tls1"].proc.pid]
        full = handshakes(ports["tls1"], tls.cert_file, args.handshakes, pids, resume=False)
        resumed = handshakes(ports["tls1"], tls.cert_file, args.handshakes, pids, resume=True)
        spread = handshakes(ports["tls"], tls.cert_file, args.handshakes, [], resume=True)
    finally:
        group.stop(first=(*FRONT, "clear", "uvicorn", "tls1"))
        if private:
            private.stop()
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)

    print(json.dumps({"server": server, "workers": workers, "levels": levels,
                      "requests": args.requests, "handshakes": args.handshakes}))
    print(f"{'clients':>7} {'mode':12} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>9} "
          f"{'failed':>7}  vs h1 TLS: req/s, p50, p99")
    for level, name in ((lv, n) for lv in levels for n in names):
        r, base = results[(level, name)], results[(level, "h1 TLS")]
        print(f"{level:7} {name:12} {r['rps']:8.0f} {r['p50']:8.2f} {r['p99']:9.2f} "
              f"{r['failed']:7.0f}  {r['rps'] / base['rps']:.2f}x "
              f"{r['p50'] / base['p50']:.2f}x {r['p99'] / base['p99']:.2f}x")
    print(f"{'handshake':10} {'ms p50':>7} {'client CPU ms':>14} {'server CPU ms':>14} "
          f"{'resumed':>8}")
    for label, h in (("full", full), ("resumed", resumed)):
        print(f"{label:10} {h['ms_p50']:7.3f} {h['client_cpu_ms']:14.3f} "
              f"{h['server_cpu_ms']:14.3f} {h['resumed']:8.0%}")
    print(f"offered tickets resumed against {workers} processes: {spread['resumed']:.0%}")
    print(f"resumed/full: time {resumed['ms_p50'] / full['ms_p50']:.2f}x, client CPU "
          f"{resumed['client_cpu_ms'] / full['client_cpu_ms']:.2f}x, server CPU "
          f"{resumed['server_cpu_ms'] / full['server_cpu_ms']:.2f}x")
    report("http2", levels={f"{lv} {n}": r for (lv, n), r in results.items()},
           handshake_full=full, handshake_resumed=resumed,
           resumed_across_processes=spread["resumed"])


if __name__ == "__main__":
    main()
