"""Shared fixtures: two tenants (alice's and bob's) with a member and an API key for each
role, a platform admin in an operator tenant, and a JSON client for the management API.

Everything runs against the real PostgreSQL and Redis the test command points at: a
single Redis, or a Redis Cluster (REDIS_URL=redis+cluster://..., the test command's
cluster pass). Tests reach it through sluice.redis's clients, which speak to either
(FLUSHDB, KEYS and SCAN go to every master of a cluster). A test that can only run on
a single Redis says why with `@pytest.mark.single_redis("reason")`: skipped on a
cluster."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sluice.localinfra import free_port
from sluice.observability import telemetry
from sluice.redis import is_cluster_url, sync_redis
from sluice.servers import DEFAULT as DEFAULT_SERVER
from sluice.servers import http_command
from tenants.models import ApiKey, Member, Tenant
from tenants.principal import AuthMethod, Principal
from tenants.roles import Role
from tenants.services import apikey_create
from tests import fastflush, parallel

T = TypeVar("T")
PASSWORD = "correct horse battery staple"
REPO = Path(__file__).resolve().parents[1]

# Every span of the in-process servers and workers lands here (tracing recorded, as it
# is in production with an OTLP endpoint); `spans` hands it to a test, emptied.
SPANS = InMemorySpanExporter()
telemetry.setup("sluice-test", mode="on")
telemetry.provider().add_span_processor(SimpleSpanProcessor(SPANS))


# The tests that put tests/replycutter.py's relay in front of one Redis server: a cluster
# client reads the topology from it and then talks to each slot's node past it.
RELAYED = pytest.mark.single_redis("a reply-cutting relay in front of one Redis server")


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get(parallel.WORKER)
    if worker and os.environ.get(parallel.MARK) != worker:
        raise pytest.UsageError(
            f"xdist worker {worker} has no Redis of its own: its settings must be "
            "tests.settings (tests/parallel.py), not DJANGO_SETTINGS_MODULE="
            f"{os.environ.get('DJANGO_SETTINGS_MODULE')}")
    config.addinivalue_line("markers", "single_redis(reason): runs on a single Redis only "
                            "(skipped when REDIS_URL is a Redis Cluster), for the reason given")
    fastflush.install()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not is_cluster_url(settings.REDIS_URL):
        return
    for item in items:
        marker = item.get_closest_marker("single_redis")
        if marker is not None:
            reason = marker.args[0] if marker.args else "needs a single Redis"
            item.add_marker(pytest.mark.skip(reason=f"single Redis only: {reason}"))


@pytest.fixture(autouse=True)
def spans() -> Iterator[InMemorySpanExporter]:
    SPANS.clear()
    yield SPANS
    SPANS.clear()


@pytest.fixture(autouse=True, scope="session")
def _fresh_redis() -> None:
    """The test Redis database starts empty: nothing from an earlier run leaks in."""
    sync_redis().flushdb()


@dataclass
class Response:
    status: int
    body: Any
    headers: dict[str, str]


class ApiClient:
    """A thin JSON client over Django's test Client (the full middleware stack)."""

    def __init__(self, token: str | None = None) -> None:
        self.client = Client()
        self.token = token

    def call(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
             token: str | None = None, headers: dict[str, str] | None = None) -> Response:
        extra: dict[str, str] = {}
        bearer = token if token is not None else self.token
        if bearer is not None:
            extra["HTTP_AUTHORIZATION"] = f"Bearer {bearer}"
        for name, value in (headers or {}).items():
            extra[f"HTTP_{name.upper().replace('-', '_')}"] = value
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        kwargs: dict[str, Any] = {"content_type": "application/json"} if data is not None else {}
        if data is not None:
            kwargs["data"] = data
        response = getattr(self.client, method.lower())(path, **kwargs, **extra)
        try:
            parsed = json.loads(response.content) if response.content else None
        except ValueError:
            parsed = response.content.decode(errors="replace")
        return Response(response.status_code, parsed, dict(response.headers))

    def get(self, path: str, **kw: Any) -> Response:
        return self.call("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> Response:
        return self.call("POST", path, body, **kw)

    def patch(self, path: str, body: Any = None, **kw: Any) -> Response:
        return self.call("PATCH", path, body, **kw)

    def delete(self, path: str, **kw: Any) -> Response:
        return self.call("DELETE", path, **kw)


@dataclass
class Org:
    tenant: Tenant
    members: dict[Role, Member] = field(default_factory=dict)
    keys: dict[Role, str] = field(default_factory=dict)  # role -> full API key secret
    key_rows: dict[Role, ApiKey] = field(default_factory=dict)

    def client(self, role: Role) -> ApiClient:
        return ApiClient(self.keys[role])


def principal_for(member: Member) -> Principal:
    return Principal(
        tenant_id=member.tenant_id, tenant_slug=member.tenant.slug, role=Role(member.role),
        subject=member.subject, method=AuthMethod.SESSION, member_id=member.pk,
    )


def make_org(slug: str, roles: list[Role]) -> Org:
    tenant = Tenant.objects.create(slug=slug, name=f"{slug.title()} Inc")
    org = Org(tenant=tenant)
    for role in roles:
        user = get_user_model().objects.create_user(
            username=f"{slug}-{role}", email=f"{role}@{slug}.example", password=PASSWORD
        )
        member = Member.objects.create(tenant=tenant, user=user, role=role)
        created = apikey_create(actor=principal_for(member), name=f"{role} key", role=role)
        org.members[role] = member
        org.keys[role] = created.secret
        org.key_rows[role] = created.key
    return org


TENANT_ROLES = [Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR]


@pytest.fixture
def alice(db: None) -> Org:
    return make_org("alice", TENANT_ROLES)


@pytest.fixture
def bob(db: None) -> Org:
    return make_org("bob", TENANT_ROLES)


@pytest.fixture
def ops(db: None) -> Org:
    """The operator's tenant, home of the platform admin."""
    return make_org("ops", [Role.PLATFORM_ADMIN])


@pytest.fixture
def anon() -> ApiClient:
    return ApiClient()


def assert_openai_error(response: Response, status: int) -> dict[str, Any]:
    assert response.status == status, response.body
    assert isinstance(response.body, dict) and set(response.body) == {"error"}, response.body
    error = response.body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    return error


def eventually(check: Callable[[], T], timeout: float = 5.0, *,
               what: str | None = None) -> T:
    """`check()`'s first truthy result, polling every 0.1 s; after `timeout`, its last
    result, or an AssertionError naming `what` when given."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            if what is not None:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            return result
        time.sleep(0.1)


def process_env(**extra: str) -> dict[str, str]:
    """The environment for another process (a second gateway, a Celery worker) that must
    share this test's PostgreSQL database (committed data: transactional_db) and Redis.
    Skips the test where the database is not one that other processes can open."""
    if connection.vendor != "postgresql":
        pytest.skip("another process needs the shared test database")
    db = connection.settings_dict
    url = (f"postgresql://{db['USER']}:{db.get('PASSWORD') or ''}@{db['HOST'] or '127.0.0.1'}"
           f":{db['PORT'] or 5432}/{db['NAME']}")
    return {**os.environ, "DATABASE_URL": url, "REDIS_URL": settings.REDIS_URL,
            "DJANGO_SETTINGS_MODULE": "sluice.settings.test", **extra}


@contextlib.contextmanager
def gateway_process(env: dict[str, str], *, output: Any = subprocess.DEVNULL,
                    server: str = DEFAULT_SERVER
                    ) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """The run command's HTTP server (sluice.servers.DEFAULT unless `server` names
    another) in a process of its own, on a free loopback port, once its /healthz
    answers: (process, base URL). Its output goes to `output`; it is stopped on the way
    out."""
    port = free_port()
    proc = subprocess.Popen(
        http_command(server, "sluice.root.asgi:application", host="127.0.0.1", port=port),
        cwd=REPO, env=env, stdout=output, stderr=output)
    base = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            try:
                return httpx.get(f"{base}/healthz", timeout=1).is_success
            except httpx.HTTPError:
                return proc.poll() is not None  # exited: stop waiting
        eventually(up, 60, what="the gateway")
        assert proc.poll() is None, "the gateway process exited"
        yield proc, base
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.fixture
def celery_worker(transactional_db: None, tmp_path: Path) -> Iterator[None]:
    """A real Celery worker process on the test broker and database (not eager mode)."""
    env = process_env(SLUICE_STATE_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "sluice.celery", "worker",
                             "--pool", "solo", "--loglevel", "WARNING", "--without-gossip",
                             "--without-mingle"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield
    proc.terminate()
    proc.wait(20)


def signed_in(org: Org, role: Role) -> Client:
    """A Django test client signed in to the admin UI as `org`'s member of `role`."""
    client = Client()
    response = client.post("/ui/login", {"username": f"{org.tenant.slug}-{role}",
                                          "password": PASSWORD})
    assert response.status_code == 302, response.content
    return client


@contextlib.contextmanager
def uvicorn_server() -> Iterator[int]:
    """The ASGI application under uvicorn in a thread, on a free loopback port, until
    the block ends: yields the port once it accepts connections."""
    import threading

    import uvicorn

    from sluice.root.asgi import application

    port = free_port()
    # Requests still open at the end are cancelled after 2 s, as `sluice run`'s servers
    # cancel theirs after 5 (a thousand streams left open held the join for its 10 s).
    server = uvicorn.Server(uvicorn.Config(application, host="127.0.0.1", port=port,
                                           lifespan="off", log_level="warning",
                                           timeout_graceful_shutdown=2))
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        serving.join(10)
