"""PostgreSQL going away under a live gateway (it refuses new connections and the open
ones are cut, as in a restart or a failover): what the gateway has cached keeps
serving, a call that needs the database gets a retriable 503 `database_unavailable`
(which the OpenAI SDKs retry), never a 500, and everything works again once the
database is back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import psycopg
import pytest
from django.db import connection

from governance import audit
from governance.models import AuditEvent
from tenants.roles import Role
from tests.conftest import make_org
from tests.streaming.conftest import Live

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def outage() -> Iterator[None]:
    """No new connections to the test database, and every open one cut but this
    test's own (PostgreSQL refuses to close the database a session is in: the switch
    is thrown from the maintenance database)."""
    settings = connection.settings_dict
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        ours = cursor.fetchone()[0]
    admin = psycopg.connect(dbname="postgres", host=settings["HOST"] or None,
                            port=settings["PORT"] or None, user=settings["USER"] or None,
                            password=settings["PASSWORD"] or None, autocommit=True)
    name = settings["NAME"]
    try:
        admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                      "WHERE datname = %s AND pid <> %s", [name, ours])
        yield
    finally:
        admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
        admin.close()


def test_a_database_outage_is_a_retriable_503_and_cached_callers_keep_working(
        live: Live) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the outage is made with PostgreSQL's ALLOW_CONNECTIONS")
    warm_org = make_org("warm", [Role.DEVELOPER])
    warm = warm_org.keys[Role.DEVELOPER]
    cold = make_org("cold", [Role.DEVELOPER]).keys[Role.DEVELOPER]
    root = live.base_url.removesuffix("/v1")

    def chat(key: str) -> httpx.Response:
        return httpx.post(f"{live.base_url}/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": "echo", "messages": [{"role": "user",
                                                               "content": "still here"}]})

    assert chat(warm).status_code == 200  # its key, model and policies now cached
    with outage():
        refused = chat(cold)  # its key must be looked up
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "database_unavailable"
        assert refused.headers["retry-after"] == "1"
        served = chat(warm)
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["message"]["content"] == "still here"
        management = httpx.get(f"{root}/api/v1/me", timeout=30,
                               headers={"Authorization": f"Bearer {cold}"})
        assert management.status_code == 503, management.text
        assert management.json()["error"]["code"] == "database_unavailable"
        # Still ready (degraded): its load balancer keeps the gateway that serves.
        ready = httpx.get(f"{root}/readyz", timeout=30)
        assert ready.status_code == 200, ready.text
        assert ready.json()["status"] == "degraded"
        assert ready.json()["checks"]["database"].startswith("error")
    assert chat(cold).status_code == 200
    # The call served during the outage is audited once the database is back (its
    # event waited in Redis).
    audit.drain()
    assert AuditEvent.objects.filter(tenant=warm_org.tenant, action="chat.completions",
                                     status=200).count() == 2
    assert httpx.get(f"{root}/api/v1/me", headers={"Authorization": f"Bearer {cold}"},
                     timeout=30).status_code == 200
