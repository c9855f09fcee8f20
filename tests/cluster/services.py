"""Sluice's parts started on the nodes of a `netns.Fabric`, each waited for until it
serves: a private PostgreSQL (initdb as the `postgres` user in a temporary directory),
Redis, gateways (the run command's HTTP server), echo model workers and the audit
writer. Every process's output goes to its node's log file, read back by `tail` when
something fails.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from secrets import token_hex
from typing import IO, Any

import httpx
import psycopg
import redis

from inference import queue as q
from sluice.localinfra import redis_binary
from sluice.redis import sync_client
from sluice.servers import DEFAULT as DEFAULT_SERVER
from sluice.servers import http_command
from tests.cluster.netns import Node

REPO = Path(__file__).resolve().parents[2]
PG_PORT, REDIS_PORT, HTTP_PORT = 5432, 6379, 8000  # each node has its own port space
DATABASE = "sluice"


def wait_until(check: Callable[[], Any], timeout: float, what: str,
               tail: Callable[[], str] = lambda: "") -> Any:
    """`check()`'s first truthy result, polling every 0.1 s; AssertionError naming
    `what` (and `tail()`, the logs) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tail()}")
        time.sleep(0.1)


def postgres_bin() -> Path | None:
    """A directory with initdb and postgres: the system's newest, else pgserver's."""
    found = sorted((p for p in Path("/usr/lib/postgresql").glob("*/bin/initdb")
                    if p.parts[-3].isdigit()), key=lambda p: int(p.parts[-3]))
    if found:
        return found[-1].parent
    try:
        import pgserver
    except ImportError:
        return None
    bundled = Path(pgserver.__file__).parent / "pginstall" / "bin"
    return bundled if (bundled / "initdb").exists() else None


def missing_tools() -> str | None:
    """What this machine lacks to run the cluster's services, or None."""
    if postgres_bin() is None:
        return "no PostgreSQL binaries (initdb, postgres)"
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "no `postgres` user to run PostgreSQL as (it refuses root)"
    if shutil.which("runuser") is None:
        return "no `runuser` (util-linux)"
    if redis_binary() is None:
        return "no redis-server binary"
    return None


@dataclass
class Logs:
    """One append-only log file per node, in `folder`."""

    folder: Path
    files: dict[str, IO[bytes]] = field(default_factory=dict)

    def of(self, node: Node) -> IO[bytes]:
        if node.name not in self.files:
            self.files[node.name] = (self.folder / f"{node.name}.log").open("ab")
        return self.files[node.name]

    def tail(self, lines: int = 15) -> str:
        out = []
        for name, handle in self.files.items():
            handle.flush()
            text = (self.folder / f"{name}.log").read_text(errors="replace").splitlines()
            if text:
                out.append(f"--- {name} (last {min(lines, len(text))} lines)")
                out += text[-lines:]
        return "\n".join(out)

    def close(self) -> None:
        for handle in self.files.values():
            handle.close()


def start_postgres(node: Node, data: Path, logs: Logs) -> str:
    """A private PostgreSQL on `node` with an empty `sluice` database, trusting the
    fabric's subnet only, its files in `data` (an empty folder): its URL."""
    binaries = postgres_bin()
    assert binaries is not None
    user = pwd.getpwnam("postgres")
    os.chown(data, user.pw_uid, user.pw_gid)
    log = logs.of(node)
    subprocess.run(["runuser", "-u", "postgres", "--", str(binaries / "initdb"), "-D",
                    str(data), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"],
                   stdout=log, stderr=log, check=True, timeout=120)
    with (data / "pg_hba.conf").open("a") as hba:
        hba.write(f"host all all {node.subnet} trust\n")
    # fsync off: this PostgreSQL is never crashed here, and the machine's disk is shared.
    node.spawn([str(binaries / "postgres"), "-D", str(data), "-p", str(PG_PORT),
                "-c", f"listen_addresses={node.address}", "-c",
                f"unix_socket_directories={data}", "-c", "fsync=off",
                "-c", "max_connections=200"], log, user="postgres")
    admin = f"postgresql://postgres@{node.address}:{PG_PORT}/postgres"

    def ready() -> bool:
        try:
            with psycopg.connect(admin, connect_timeout=2, autocommit=True) as conn:
                conn.execute(f"CREATE DATABASE {DATABASE}")
            return True
        except psycopg.OperationalError:
            return False

    wait_until(ready, 60, "PostgreSQL", logs.tail)
    return f"postgresql://postgres@{node.address}:{PG_PORT}/{DATABASE}"


def start_redis(node: Node, data: Path, logs: Logs) -> str:
    """A single Redis on `node` (no persistence: it is not restarted here; `data` is its
    working folder)."""
    binary = redis_binary()
    assert binary is not None
    node.spawn([binary, "--bind", node.address, "--port", str(REDIS_PORT), "--save", "",
                "--appendonly", "no", "--protected-mode", "no", "--dir", str(data),
                "--loglevel", "warning"], logs.of(node))
    url = f"redis://{node.address}:{REDIS_PORT}/0"

    def ready() -> bool:
        try:
            return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
        except redis.RedisError:
            return False

    wait_until(ready, 30, "Redis", logs.tail)
    return url


@dataclass
class Platform:
    """The environment every Sluice process of the cluster shares."""

    database_url: str
    redis_url: str  # a single Redis or a cluster (redis+cluster://)
    logs: Logs
    state: Path  # a folder; each node gets its own state directory under it
    request_timeout_s: int
    # Beside a cluster: the single Redis of what cannot use one (Celery, Channels).
    single_redis_url: str | None = None
    secret: str = field(default_factory=lambda: token_hex(32))

    def env(self, node: Node | None = None, **extra: str) -> dict[str, str]:
        state = self.state / (node.name if node is not None else "host")
        state.mkdir(exist_ok=True)
        return {**os.environ, "DATABASE_URL": self.database_url, "REDIS_URL": self.redis_url,
                "DJANGO_SETTINGS_MODULE": "sluice.settings.test",
                "SLUICE_SECRET_KEY": self.secret, "SLUICE_STATE_DIR": str(state),
                "SLUICE_ALLOWED_HOSTS": "*", "SLUICE_LOG_LEVEL": "WARNING",
                "SLUICE_REQUEST_TIMEOUT_S": str(self.request_timeout_s),
                **({"SLUICE_CELERY_REDIS_URL": self.single_redis_url}
                   if self.single_redis_url else {}), **extra}

    def redis(self) -> Any:
        """A client of the platform's Redis (a cluster client on a cluster)."""
        return sync_client(self.redis_url, socket_timeout=5, socket_connect_timeout=2)

    def ops(self, *args: str) -> dict[str, Any]:
        """`python -m tests.cluster.ops <args>` from the host, its JSON."""
        what = args[0]
        done = subprocess.run([sys.executable, "-m", "tests.cluster.ops", *args], cwd=REPO,
                              env=self.env(), capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise AssertionError(f"ops {what} failed:\n{done.stderr[-3000:]}")
        return dict(json.loads(done.stdout.splitlines()[-1]))

    def start_gateway(self, node: Node) -> str:
        """The HTTP gateway on `node`, once its /healthz answers: its base URL."""
        proc = node.spawn(http_command(DEFAULT_SERVER, "sluice.root.asgi:application",
                                       host=node.address, port=HTTP_PORT),
                          self.logs.of(node), env=self.env(node), cwd=REPO)
        base = node.url("http", HTTP_PORT)

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"gateway on {node.name} exited\n{self.logs.tail()}")
            try:
                return httpx.get(f"{base}/healthz", timeout=1).is_success
            except httpx.HTTPError:
                return False

        wait_until(up, 90, f"the gateway on {node.name}", self.logs.tail)
        return base

    def start_worker(self, node: Node, spec: str, model: str) -> subprocess.Popen[bytes]:
        """An echo model worker on `node`, once its heartbeat is in Redis."""
        proc = node.spawn([sys.executable, "-m", "inference.worker", "--spec", spec,
                           "--redis-url", self.redis_url, "--reclaim-after-ms", "1500"],
                          self.logs.of(node), env=self.env(node), cwd=REPO)
        rds = self.redis()

        def beating() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"worker on {node.name} exited\n{self.logs.tail()}")
            beats = q.live_heartbeats(rds.hgetall(q.workers_key(model)))
            return any(beat.get("pid") == proc.pid for beat in beats.values())

        try:
            wait_until(beating, 90, f"the worker on {node.name}", self.logs.tail)
        finally:
            rds.close()
        return proc

    def start_auditwriter(self, node: Node) -> subprocess.Popen[bytes]:
        return node.spawn([sys.executable, "manage.py", "auditwriter"], self.logs.of(node),
                          env=self.env(node), cwd=REPO)
