"""`sluice`: run the whole platform locally, or run the test suite.

    sluice run  [--host H] [--port P]   Redis (private if none), migrate, seed, serve
    sluice test [pytest args...]        PostgreSQL + Redis (private if none), lint, pytest
    sluice manage <command> [...]       Django management commands

dev.sh creates the virtualenv and then calls these.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sluice.localinfra import (
    Started,
    StartedCluster,
    ensure_postgres,
    ensure_redis,
    start_redis_cluster,
)
from sluice.private_files import DIR_MODE, FILE_MODE, narrow
from sluice.processes import ProcessGroup
from sluice.servers import DEFAULT as DEFAULT_SERVER
from sluice.servers import (
    MAX_DEFAULT_WORKERS,
    SERVERS,
    Tls,
    choose,
    default_workers,
    http_command,
)

# The checkout: the folder above this one that holds manage.py (wherever in the kernel
# this module sits).
REPO = next(p for p in Path(__file__).resolve().parents if (p / "manage.py").is_file())
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
# Tests use their own Redis database index and a PostgreSQL `test_*` database that
# pytest-django creates and drops, so they never touch a developer's data.
TEST_REDIS = "redis://127.0.0.1:6379/15"
TEST_DATABASE = "postgresql://postgres@127.0.0.1:5432/test"


def _say(message: str) -> None:
    print(f"sluice: {message}", flush=True)


def _wait_ready(url: str, timeout_s: float, group: ProcessGroup) -> None:
    deadline = time.monotonic() + timeout_s
    # Our own child on the address we gave it: whether it is up, not who it is.
    unverified = ssl.create_default_context()
    unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1,  # noqa: S310 - loopback
                                        context=unverified) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if any(c.proc.poll() is not None for c in group.children.values()):
            raise RuntimeError("a process exited during start-up (see its output above)")
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready in {timeout_s:.0f}s")


def private_state(state_dir: Path, database: Mapping[str, Any]) -> None:
    """The state dir 0700 and the SQLite database 0600, made so before anything opens
    it (never readable by others, not even for a moment); this process and those it
    starts create files owner-only (umask 077) whatever the shell's umask."""
    os.umask(0o077)
    state_dir.mkdir(parents=True, exist_ok=True)
    state_dir.chmod(DIR_MODE)
    if database["ENGINE"] == "django.db.backends.sqlite3":
        path = Path(database["NAME"])
        # An empty file is an empty SQLite database; its journal files take its mode.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        os.fchmod(fd, FILE_MODE)
        os.close(fd)
        for suffix in ("-journal", "-wal", "-shm"):
            narrow(Path(f"{path}{suffix}"))


def cmd_run(args: argparse.Namespace) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sluice.settings.base")
    scheme = "https" if os.environ.get("SLUICE_TLS_CERT_FILE", "").strip() else "http"
    base = f"{scheme}://{args.host}:{args.port}"
    os.environ.setdefault("SLUICE_PUBLIC_URL", base)
    started: list[Started] = []
    group = ProcessGroup()
    group.install_signal_handlers()
    try:
        redis_url, redis_started = ensure_redis(os.environ.get("REDIS_URL", DEFAULT_REDIS))
        if redis_started:
            started.append(redis_started)
            _say(f"no Redis reachable; started a private {redis_started.name}")
        os.environ["REDIS_URL"] = redis_url

        import django
        from django.core.management import call_command

        django.setup()
        from django.conf import settings

        private_state(Path(settings.STATE_DIR), settings.DATABASES["default"])
        from governance.services import demo_money_seed, publish_guards
        from inference.services import deployment_seed_defaults
        from tenants.services import demo_seed

        call_command("migrate", interactive=False, verbosity=0)
        creds = demo_seed()
        budget = demo_money_seed(tenant_slug=creds.tenant)
        # One /metrics for every local serving process (HTTP workers, gRPC, Celery):
        # each writes its series here, and a scrape sums them. Fresh on every start.
        metrics_dir = Path(settings.STATE_DIR) / "prometheus"
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(parents=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        deployments = [d for d in deployment_seed_defaults() if d.enabled]
        publish_guards()  # workers read the memory guard's thresholds from Redis

        tls = (Tls(settings.SLUICE_TLS_CERT_FILE, settings.SLUICE_TLS_KEY_FILE)
               if settings.SLUICE_TLS_CERT_FILE else None)
        server = choose(args.server, tls=tls is not None, http=settings.SLUICE_HTTP_VERSION)
        try:
            for pair in (tls, Tls(settings.SLUICE_GRPC_TLS_CERT_FILE,
                                  settings.SLUICE_GRPC_TLS_KEY_FILE)):
                if pair is not None and pair.cert_file:
                    pair.check()
            serving = http_command(server, "sluice.root.asgi:application", host=args.host,
                                   port=args.port, tls=tls, http=settings.SLUICE_HTTP_VERSION,
                                   workers=args.workers or default_workers(server))
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None
        group.env = dict(os.environ)
        group.start("http", serving)
        grpc_address = f"{args.host}:{args.grpc_port}"
        group.start("grpc", [sys.executable, str(REPO / "manage.py"), "rungrpc",
                             "--address", grpc_address])
        # The audit writer: events from the Redis stream into the database.
        group.start("auditwriter", [sys.executable, str(REPO / "manage.py"), "auditwriter"])
        # The responses writer: stored responses (Responses API) from Redis into the database.
        group.start("responseswriter", [sys.executable, str(REPO / "manage.py"),
                                        "responseswriter"])
        # Celery, one worker per queue so that batches never hold up exports and the
        # periodic jobs. The prefork pool: its children are where task time limits are
        # enforced (the solo and thread pools cannot stop a task); two children for
        # batch chunks (two tenants at once), one for maintenance, which also runs beat.
        celery = [sys.executable, "-m", "celery", "-A", "sluice.celery", "worker",
                  "--pool", "prefork", "--loglevel", "WARNING"]
        group.start("celery", [
            *celery, "--queues", "maintenance", "--concurrency", "1", "--hostname",
            "maintenance@%h", "--beat",
            "--schedule", str(Path(settings.STATE_DIR) / "celerybeat-schedule"),
        ])
        group.start("celery-batches", [*celery, "--queues", "batches", "--concurrency", "2",
                                       "--hostname", "batches@%h"])
        # Model workers: the autoscaler runs them as its children, as many as demand
        # asks for within each deployment's min/max replicas, and replaces dead ones.
        group.start("autoscaler", [sys.executable, str(REPO / "manage.py"), "autoscale"])
        _wait_ready(f"{base}/readyz", 60, group)
        print(_banner(base, redis_url, redis_started, creds, [d.name for d in deployments],
                      budget, grpc_address, server), flush=True)

        def restarted(name: str, code: int, delay: float) -> None:
            _say(f"process {name!r} exited with code {code}; restarting it in {delay:.0f}s")

        exited = group.supervise(on_restart=restarted)
        if exited is not None:
            _say(f"process {exited[0]!r} keeps exiting (code {exited[1]}); stopping "
                 "everything")
            return 1
        return 0
    except RuntimeError as exc:
        _say(f"error: {exc}")
        return 1
    finally:
        # The servers first: their in-flight calls finish (each server's graceful
        # timeout) while the workers, the audit writer and Celery still run.
        group.stop(first=("http", "grpc"))
        for item in started:
            item.stop()
        _say("stopped")


def _banner(base: str, redis_url: str, redis_started: Started | None, creds: object,
            models: list[str], budget: Any, grpc_address: str, server: str) -> str:
    key = getattr(creds, "api_key", "")
    user, password = getattr(creds, "username", ""), getattr(creds, "password", "")
    tenant = getattr(creds, "tenant", "")
    redis_note = " (private, stops with Sluice)" if redis_started else ""
    from django.conf import settings

    db = settings.DATABASES["default"]
    grpc_cert = settings.SLUICE_GRPC_TLS_CERT_FILE
    grpc_note = f"TLS: grpcurl -cacert {grpc_cert}" if grpc_cert else "grpcurl -plaintext"
    return f"""
Sluice is running.
  OpenAI-compatible base URL  {base}/v1
  HTTP server                 {server} (HTTP version {settings.SLUICE_HTTP_VERSION})
  gRPC (sluice.v1.Inference)  {grpc_address}   (reflection on; {grpc_note})
  Admin UI                    {base}/ui/   (sign in with the login below)
  Management API docs         {base}/api/docs
  Readiness                   {base}/readyz
  Prometheus metrics          {base}/metrics   (loopback, or SLUICE_METRICS_TOKEN)
  JWKS                        {base}/.well-known/jwks.json
  Database                    {db["ENGINE"].rsplit(".", 1)[-1]} {db["NAME"]}
  Redis                       {redis_url}{redis_note}
  Model workers               {", ".join(models) or "none"} (autoscaled; the first
                              start converts the chat model's weights once: ~30 s)
  Celery                      batches worker; maintenance worker + beat (usage
                              and spend rollups, retention, exports); audit writer;
                              responses writer

  Login     {user} / {password}   (tenant {tenant}, platform admin)
  API key   {key}   (developer)
  Spend     each reply's cost is its x-sluice-cost-usd header; over time (chart,
            CSV, budgets): {base}/ui/spend; the prices:
            {base}/api/v1/governance/prices; the tenant's budget
            (${budget.limit_usd.normalize():f} a month, spent so far):
            {base}/api/v1/governance/budgets/{budget.pk}   (as the admin)

Try it:
  curl -s {base}/api/v1/me -H "Authorization: Bearer {key}"
  curl -s {base}/v1/models -H "Authorization: Bearer {key}"
  curl -s -X POST {base}/v1/auth/token -H "Content-Type: application/json" \\
       -d '{{"grant_type": "api_key", "api_key": "{key}"}}'

Press Ctrl-C to stop.
"""


def _cluster_mode(args: argparse.Namespace) -> str:
    """"off", "also" (after the single-Redis pass) or "only": --redis-cluster, else
    SLUICE_TEST_REDIS_CLUSTER (1/also, only, 0/off), else "also" under CI=true."""
    wanted = args.redis_cluster or os.environ.get("SLUICE_TEST_REDIS_CLUSTER", "")
    wanted = {"1": "also", "true": "also", "0": "off", "false": "off", "": ""}.get(
        wanted.lower(), wanted.lower())
    if wanted not in ("", "off", "also", "only"):
        raise RuntimeError(f"--redis-cluster / SLUICE_TEST_REDIS_CLUSTER: {wanted!r} is "
                           "not one of off, also, only")
    return wanted or ("also" if os.environ.get("CI", "").lower() == "true" else "off")


def _names_tests(pytest_args: list[str]) -> bool:
    """Whether the pytest arguments name tests (a path, or path::test) to run."""
    return any(not a.startswith("-") and (REPO / a.split("::")[0]).exists()
               for a in pytest_args)


def _parallel(pytest_args: list[str]) -> tuple[list[str], int]:
    """pytest-xdist's options for a run and its number of workers: as many as the cores
    this process may use, unless the arguments choose (`-n 0` runs serially; `-p
    no:xdist` too). Each module runs whole on one worker (`--dist loadfile`, the
    largest first): a module-scoped fixture (a server, a model, a cluster of network
    namespaces) is built once, and a module's tests keep their order. (`xdist_group`
    and `--dist loadgroup` have no effect with pytest 9.2: xdist 3.8 marks a group in
    a node id attribute pytest no longer reads.) tests/parallel.py says what each
    worker owns."""
    given = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    given.add_argument("-n", "--numprocesses")
    given.add_argument("--tx", action="append")
    given.add_argument("--dist")
    given.add_argument("-p", action="append", default=[])
    known, _ = given.parse_known_args(pytest_args)
    if "no:xdist" in known.p:
        return [], 0
    dist = [] if known.dist else ["--dist", "loadfile"]
    if known.tx:
        return dist, len(known.tx)
    if known.numprocesses is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1
        return ["-n", str(cores), *dist], cores
    if known.numprocesses.isdigit():
        workers = int(known.numprocesses)
        return (dist if workers else []), workers
    return dist, os.cpu_count() or 1  # "auto" / "logical": xdist counts


def _pytest(pytest_args: list[str], env: Mapping[str, str], what: str) -> int:
    _say(f"pytest on {what}")
    began = time.monotonic()
    # In CI, the slowest tests are named at the end: the suite's time is kept under watch.
    slowest = ["--durations=30"] if os.environ.get("CI", "").lower() == "true" else []
    code = subprocess.call([sys.executable, "-m", "pytest", *slowest, *pytest_args],  # noqa: S603
                           cwd=REPO, env=env)
    _say(f"pytest on {what}: exit {code} in {time.monotonic() - began:.0f} s")
    if code == 5:
        _say("pytest collected no tests: that is a failure")
        return 1
    return code


def _cluster_pass(pytest_args: list[str], env: dict[str, str]) -> int:
    """The tests marked `cluster` (all the tests named, when some are) again with
    REDIS_URL on a private Redis Cluster (3 masters, 3 replicas) per xdist worker (a
    cluster has one database: workers cannot share one), Celery and Channels on the
    single Redis of the first pass (they cannot use a cluster)."""
    parallel, workers = _parallel(pytest_args)
    clusters: list[StartedCluster] = []
    try:
        # A long node timeout: no test here fails a node over on purpose (the failover
        # tests start clusters of their own), and a starved CI machine must not trigger one.
        for _ in range(max(workers, 1)):
            clusters.append(start_redis_cluster(masters=3, replicas=1, node_timeout_ms=15000))
        selection = [] if _names_tests(pytest_args) else ["-m", "cluster"]
        return _pytest([*parallel, *selection, *pytest_args], {
            **env, "REDIS_URL": clusters[0].url,
            "SLUICE_TEST_REDIS_URLS": " ".join(c.url for c in clusters),
            "SLUICE_CELERY_REDIS_URL": env["REDIS_URL"],
            "SLUICE_CHANNELS_REDIS_URL": env["REDIS_URL"]},
            ", ".join(c.name for c in clusters))
    finally:
        for cluster in clusters:
            cluster.stop()


def _mypy_cache() -> str:
    """mypy's incremental cache, outside the checkout (as pip's is): shared by every
    clone and worktree of this user, so that a fresh clone checks in seconds what it
    would take a minute to check from nothing. `$XDG_CACHE_HOME/sluice-mypy`, else
    `~/.cache/sluice-mypy`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "sluice-mypy")


def cmd_test(args: argparse.Namespace, pytest_args: list[str]) -> int:
    started: list[Started] = []
    # A SIGTERM (a CI job's timeout) unwinds like Ctrl-C: the servers started here stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        cluster = _cluster_mode(args)
        db_url, pg = ensure_postgres(os.environ.get("DATABASE_URL", TEST_DATABASE))
        if pg:
            started.append(pg)
            _say(f"no PostgreSQL reachable; started a {pg.name}")
        redis_url, rs = ensure_redis(os.environ.get("REDIS_URL", TEST_REDIS))
        if rs:
            started.append(rs)
            _say(f"no Redis reachable; started a private {rs.name}")
        with tempfile.TemporaryDirectory(prefix="sluice-test-state-") as state:
            env = {
                **os.environ,
                "DATABASE_URL": db_url,
                "REDIS_URL": redis_url,
                "DJANGO_SETTINGS_MODULE": "tests.settings",
                "SLUICE_STATE_DIR": state,
                "PYTHONDONTWRITEBYTECODE": "1",
            }
            if not args.no_lint:
                for tool in (["ruff", "check", "."], ["mypy", "--cache-dir", _mypy_cache()]):
                    _say(" ".join(tool))
                    lint = subprocess.call([sys.executable, "-m", *tool], cwd=REPO, env=env)  # noqa: S603
                    if lint != 0:
                        return lint
            parallel = _parallel(pytest_args)[0]
            code = 0 if cluster == "only" else _pytest([*parallel, *pytest_args], env,
                                                       redis_url)
            if cluster != "off":
                code = _cluster_pass(pytest_args, env) or code
        return code
    except RuntimeError as exc:
        _say(f"error: {exc}")
        return 1
    finally:
        for item in started:
            item.stop()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the platform locally")
    run.add_argument("--host", default=os.environ.get("SLUICE_HOST", "127.0.0.1"))
    run.add_argument("--port", type=int, default=int(os.environ.get("SLUICE_PORT", "8000")))
    run.add_argument("--workers", type=int, default=None,
                     help="HTTP processes (default: SLUICE_HTTP_WORKERS, else one per core, "
                          f"up to {MAX_DEFAULT_WORKERS}; daphne runs one)")
    run.add_argument("--server", choices=SERVERS,
                     default=os.environ.get("SLUICE_HTTP_SERVER") or None,
                     help=f"ASGI server for REST, SSE and WebSocket (default {DEFAULT_SERVER}; "
                          "granian when SLUICE_TLS_CERT_FILE or SLUICE_HTTP_VERSION=2 asks "
                          "for HTTP/2)")
    run.add_argument("--grpc-port", type=int,
                     default=int(os.environ.get("SLUICE_GRPC_PORT", "50051")))
    test = sub.add_parser("test", help="run the test suite (extra args go to pytest)")
    test.add_argument("--no-lint", action="store_true")
    test.add_argument("--redis-cluster", choices=("off", "also", "only"), default=None,
                      help="run the Redis tests again on a private Redis Cluster after the "
                           "single-Redis pass (also), instead of it (only), or not (off); "
                           "default SLUICE_TEST_REDIS_CLUSTER, else also under CI=true")
    sub.add_parser("manage", help="Django management commands", add_help=False)

    if argv[:1] == ["manage"]:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sluice.settings.base")
        from django.core.management import execute_from_command_line

        execute_from_command_line(["sluice manage", *argv[1:]])
        return 0
    args, rest = parser.parse_known_args(argv)
    if args.command == "test":
        return cmd_test(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
