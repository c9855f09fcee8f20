"""The UI's list cursors (`?after=` / `?before=`, frontend.paging): a cursor that is not
an id is ignored (the list's first page), never a server error. Every page of the UI is
tried, as every role, read from the URL configuration so a new list is covered."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import URLPattern

from frontend.urls import urlpatterns
from governance.models import AuditEvent
from inference.models import Deployment
from tenants.roles import Role
from tests.conftest import Org
from tests.frontend.test_pages import signed_in

pytestmark = pytest.mark.django_db

# "²" passes str.isdigit and fails int(); 4,301 digits is past int()'s limit for text.
BAD_CURSORS = ["\u00b2", "\u0663", "9" * 4301, "-1", "1e9", " 5", ""]
# Not pages: sign-in and -out, the server-sent event stream (it never ends).
NOT_PAGES = {"login", "logout", "live/stream"}
PAGES = [f"/ui/{p.pattern}" for p in urlpatterns
         if isinstance(p, URLPattern) and "<" not in str(p.pattern)
         and str(p.pattern) not in NOT_PAGES]


def _statuses(client: Client, query: str) -> dict[str, int]:
    return {url: client.get(f"{url}{query}").status_code for url in PAGES}


@pytest.mark.parametrize(("who", "role"), [("ops", Role.PLATFORM_ADMIN),
                                           ("alice", Role.TENANT_ADMIN),
                                           ("alice", Role.DEVELOPER),
                                           ("alice", Role.AUDITOR)])
def test_a_bad_cursor_on_any_page_is_ignored(ops: Org, alice: Org, who: str,
                                             role: Role) -> None:
    # Given every page of the UI and a signed-in user of each role
    Deployment.objects.create(name="echo", runtime="echo")
    client = signed_in(ops if who == "ops" else alice, role)
    plain = _statuses(client, "")
    assert 200 in plain.values()
    # When each page is asked with cursors that are not ids, then it answers as it does
    # without one.
    for cursor in BAD_CURSORS:
        for query in (f"?before={cursor}", f"?after={cursor}",
                      f"?before={cursor}&after={cursor}"):
            assert _statuses(client, query) == plain, (role, query[:40])


def test_a_bad_cursor_shows_the_first_page(alice: Org) -> None:
    # Given more audit events than a page holds (newest first)
    client = signed_in(alice, Role.AUDITOR)
    for n in range(55):
        AuditEvent.objects.create(chain="alice", seq=n + 1, prev_hash="0" * 64,
                                  hash=f"{n:064d}", at="2026-01-01T00:00:00Z",
                                  tenant=alice.tenant, action=f"probe.{n:02d}")
    first = client.get("/ui/audit").content
    assert b"probe.54" in first and b"probe.04" not in first
    # When the cursor is "²", then it is the first page, not a 500
    response = client.get("/ui/audit?before=\u00b2")
    assert response.status_code == 200 and b"probe.54" in response.content
    # and a real cursor still pages.
    older = AuditEvent.objects.get(action="probe.05").pk
    assert b"probe.04" in client.get(f"/ui/audit?before={older}").content
