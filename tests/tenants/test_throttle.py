"""Credential guessing is throttled per source on a username, per username and per
source, with backoff that always ends; wrong API keys on every HTTP surface count per
source; deactivated accounts answer like wrong passwords; every attempt is audited
without its secret. Against a live server (uvicorn on loopback, the real ASGI app);
clients bind different loopback addresses (127.0.0.x) to be different sources."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from django.contrib.auth.hashers import MD5PasswordHasher
from django.db import connection
from django.test.utils import CaptureQueriesContext

from governance import audit
from governance.models import AuditEvent
from sluice.errors import Unauthenticated
from sluice.redis import sync_redis
from tenants import cache as auth_cache
from tenants import throttle
from tenants.models import Member
from tenants.roles import Role
from tenants.services import member_sign_in
from tests.conftest import PASSWORD, Org, make_org, uvicorn_server

pytestmark = pytest.mark.cluster

WRONG = "not-the-password-0xC0FFEE"


def forget_throttle() -> None:
    """No counter, lock or held source from an earlier test."""
    client = sync_redis()
    for key in list(client.scan_iter("sluice:auth:*")):
        if key != b"sluice:auth:epoch":
            client.delete(key)
    throttle.clear()
    auth_cache.clear()


@pytest.fixture
def server(transactional_db: None, settings: Any) -> Iterator[str]:
    """The ASGI app on a loopback port, its data committed. Thresholds as in production
    but for the source's (20); every lock lasts 30 s, far longer than a test's burst
    even on a loaded machine, so which attempt is refused is exact (a test of the
    backoff's growth sets its own)."""
    settings.SLUICE_AUTH_ACCOUNT_FAILURES = 5
    settings.SLUICE_AUTH_ACCOUNT_SOURCES = 5
    settings.SLUICE_AUTH_SOURCE_FAILURES = 20
    settings.SLUICE_AUTH_BACKOFF_S = settings.SLUICE_AUTH_BACKOFF_MAX_S = 30
    forget_throttle()
    with uvicorn_server() as port:
        yield f"http://127.0.0.1:{port}"
    audit.drain()
    forget_throttle()


def client_from(base: str, address: str) -> httpx.Client:
    """An HTTP client whose connections come from `address` (a loopback address)."""
    return httpx.Client(base_url=base, timeout=30,
                        transport=httpx.HTTPTransport(local_address=address))


def password_token(http: httpx.Client, username: str, password: str) -> httpx.Response:
    return http.post("/v1/auth/token", json={"grant_type": "password", "username": username,
                                             "password": password})


def assert_throttled(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    assert set(response.json()) == {"error"}
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "too_many_failed_attempts"
    assert 1 <= int(response.headers["retry-after"]) <= 300


def auth_events() -> list[AuditEvent]:
    audit.drain()
    return list(AuditEvent.objects.filter(action__startswith="auth.").order_by("id"))


def row_text(event: AuditEvent) -> str:
    return json.dumps({f.name: str(getattr(event, f.attname))
                       for f in AuditEvent._meta.concrete_fields})


# -- passwords -------------------------------------------------------------------------
def test_a_hundred_wrong_passwords_are_429_with_retry_after(server: str) -> None:
    # Given alice's developer, and an attacker at one address
    org = make_org("alice", [Role.DEVELOPER])
    username = org.members[Role.DEVELOPER].user.username
    with client_from(server, "127.0.0.2") as attacker:
        # When it tries 100 wrong passwords
        answers = [password_token(attacker, username, f"{WRONG}{i}") for i in range(100)]
        # Then 4 are refused as wrong, the 5th starts the lock, the rest are 429s
        assert [a.status_code for a in answers] == [401] * 4 + [429] * 96
        for answer in answers[4:]:
            assert_throttled(answer)
        # and the right password is not even checked while the lock runs
        assert_throttled(password_token(attacker, username, PASSWORD))


def test_backoff_doubles_from_the_threshold(server: str, settings: Any) -> None:
    # Given locks of 1 s doubling up to 300 s
    settings.SLUICE_AUTH_BACKOFF_S, settings.SLUICE_AUTH_BACKOFF_MAX_S = 1, 300
    org = make_org("alice", [Role.DEVELOPER])
    username = org.members[Role.DEVELOPER].user.username
    with client_from(server, "127.0.0.8") as attacker:
        # When an attacker keeps trying until a lock of 4 s has started
        seen: list[int] = []
        deadline = time.monotonic() + 60
        while 4 not in seen:
            answer = password_token(attacker, username, WRONG)
            if answer.status_code == 429:
                seen.append(int(answer.headers["retry-after"]))
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
        # Then the right password is refused unchecked, that lock running
        assert_throttled(password_token(attacker, username, PASSWORD))
    # and the failures that were checked locked for 1 s, 2 s, then 4 s
    failed = [e for e in auth_events() if e.action == "auth.failed"]
    assert [e.detail.get("locked_s") for e in failed] == [None] * 4 + [1, 2, 4]


def test_one_attacking_source_cannot_lock_the_real_user_out(server: str) -> None:
    # Given an attacker at one address who has locked itself out of alice's account
    org = make_org("alice", [Role.DEVELOPER])
    username = org.members[Role.DEVELOPER].user.username
    with client_from(server, "127.0.0.2") as attacker, \
            client_from(server, "127.0.0.3") as user:
        for i in range(8):
            password_token(attacker, username, f"{WRONG}{i}")
        assert_throttled(password_token(attacker, username, f"{WRONG}x"))
        # When the real user signs in from another address, meanwhile
        signed_in = password_token(user, username, PASSWORD)
        # Then the user is in, and the attacker is still held
        assert signed_in.status_code == 200, signed_in.text
        assert_throttled(password_token(attacker, username, f"{WRONG}y"))


def test_many_sources_lock_the_username_for_a_bounded_time_but_not_for_known_ones(
        server: str, settings: Any) -> None:
    # Given a lock of 6 s from the 3rd source failing on alice's developer, and the user
    # who signed in from 127.0.0.9 before
    settings.SLUICE_AUTH_ACCOUNT_SOURCES = 3
    settings.SLUICE_AUTH_BACKOFF_S = settings.SLUICE_AUTH_BACKOFF_MAX_S = 6
    org = make_org("alice", [Role.DEVELOPER])
    username = org.members[Role.DEVELOPER].user.username
    with client_from(server, "127.0.0.9") as usual, \
            client_from(server, "127.0.0.10") as fresh:
        assert password_token(usual, username, PASSWORD).status_code == 200
        # When three addresses each try a wrong password
        answers = []
        for address in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
            with client_from(server, address) as bot:
                answers.append(password_token(bot, username, WRONG).status_code)
        assert answers == [401, 401, 429]
        # Then an address that never signed in is refused, even with the right password
        assert_throttled(password_token(fresh, username, PASSWORD))
        # but the user's usual address is not
        assert password_token(usual, username, PASSWORD).status_code == 200
        # and once the window has passed, the fresh address signs in too, though one
        # attacking address kept trying all along (refusals do not extend a lock)
        began = time.monotonic()
        with client_from(server, "127.0.0.2") as bot:
            def attack_then_sign_in() -> bool:
                password_token(bot, username, WRONG)
                return password_token(fresh, username, PASSWORD).status_code == 200
            deadline = time.monotonic() + 30
            while not attack_then_sign_in():
                assert time.monotonic() < deadline, "the lock did not end"
                time.sleep(0.2)
        assert time.monotonic() - began < 20


def ui_sign_in(browser: httpx.Client, username: str, password: str) -> httpx.Response:
    """The sign-in page, filled in and posted as a browser would (CSRF token included)."""
    page = browser.get("/ui/login")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert token is not None
    return browser.post("/ui/login", data={
        "csrfmiddlewaretoken": token.group(1), "username": username, "password": password})


def test_ui_login_is_throttled_inline(server: str) -> None:
    # Given alice's developer and an attacker at one address using the sign-in page
    org = make_org("alice", [Role.DEVELOPER])
    username = org.members[Role.DEVELOPER].user.username
    with client_from(server, "127.0.0.5") as browser:
        def sign_in(password: str) -> httpx.Response:
            return ui_sign_in(browser, username, password)
        # When it tries 30 wrong passwords
        answers = [sign_in(f"{WRONG}{i}") for i in range(30)]
        # Then from the 5th on the page says so inline, and never echoes the password
        throttled = ["Too many failed sign-in attempts" in a.text for a in answers]
        assert throttled == [False] * 4 + [True] * 26
        assert all("Incorrect username or password." in a.text for a in answers[:4])
        assert all('role="alert"' in a.text and WRONG not in a.text for a in answers)
        assert "Too many failed sign-in attempts" in sign_in(PASSWORD).text
        assert "sessionid" not in browser.cookies


# -- API keys --------------------------------------------------------------------------
SURFACES = {
    # surface: (address, how to present a key)
    "lean /v1": ("127.0.0.11", lambda http, key: http.post(
        "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
        json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})),
    "management API": ("127.0.0.12", lambda http, key: http.get(
        "/api/v1/me", headers={"Authorization": f"Bearer {key}"})),
    "token endpoint": ("127.0.0.13", lambda http, key: http.post(
        "/v1/auth/token", json={"grant_type": "api_key", "api_key": key})),
}


@pytest.mark.parametrize("surface", list(SURFACES))
def test_wrong_api_keys_from_one_source_are_429_on_every_surface(server: str,
                                                                 surface: str) -> None:
    # Given a real key, used once from the attacker's address (its principal is cached)
    org = make_org("alice", [Role.DEVELOPER])
    good = org.keys[Role.DEVELOPER]
    address, present = SURFACES[surface]
    with client_from(server, address) as attacker, \
            client_from(server, "127.0.0.14") as neighbour:
        assert present(attacker, good).status_code != 401
        # When that address presents 40 wrong keys (guessed secrets of a real prefix)
        prefix = good.split("-")[2]
        answers = [present(attacker, f"sk-sluice-{prefix}-GUESSEDSECRET{i:04d}")
                   for i in range(40)]
        # Then the first 19 are 401, and from the 20th on every one is a 429
        assert [a.status_code for a in answers] == [401] * 19 + [429] * 21
        for answer in answers[19:]:
            assert_throttled(answer)
        # and another address is not affected
        assert present(neighbour, good).status_code not in (401, 429)
    if surface == "lean /v1":  # a principal already cached costs nothing and passes
        with client_from(server, address) as attacker:
            assert present(attacker, good).status_code == 404  # model_not_found: past auth
    # and the flood was audited once per failure up to the lock, not once per request
    # (the rest were refused in process: neither the database nor Redis was asked)
    events = [e for e in auth_events() if e.detail.get("source") == throttle.source_tag(address)]
    assert [e.status for e in events] == [401] * 19 + [429], [e.action for e in events]
    assert all(e.target == f"apikey:{prefix}" and e.tenant_id == org.tenant.pk for e in events)
    assert not any("GUESSEDSECRET" in row_text(e) for e in events)


# -- audit -----------------------------------------------------------------------------
def test_failed_and_throttled_sign_ins_are_audited_without_the_password(server: str) -> None:
    # Given alice's developer
    org = make_org("alice", [Role.DEVELOPER])
    username = org.members[Role.DEVELOPER].user.username
    with client_from(server, "127.0.0.6") as attacker:
        # When an attacker tries wrong passwords until it is throttled, then the right one
        for i in range(7):
            password_token(attacker, username, f"{WRONG}{i}")
        password_token(attacker, username, PASSWORD)
    # Then each checked failure is an auth.failed event, the first refusal under the lock
    # an auth.throttled one; all name the user and a pseudonym of the address
    events = [e for e in auth_events() if e.target == f"user:{username}"]
    failed = [e for e in events if e.action == "auth.failed"]
    throttled = [e for e in events if e.action == "auth.throttled"]
    assert [e.status for e in failed[:5]] == [401] * 4 + [429], [e.status for e in failed]
    assert len(throttled) == 1 and throttled[0].status == 429
    tag = throttle.source_tag("127.0.0.6")
    assert all(e.detail["source"] == tag and e.detail["method"] == "password" for e in events)
    assert all(e.actor == "anonymous" for e in events)
    # and no event holds the password, wrong or right, nor the address itself
    for event in events:
        text = row_text(event)
        assert WRONG not in text and PASSWORD not in text and "127.0.0.6" not in text


# -- the deactivated-account oracle ----------------------------------------------------
def test_deactivated_accounts_answer_like_a_wrong_password(server: str) -> None:
    # Given a developer whose membership was deactivated, one whose user was, and a
    # third still active
    org = make_org("alice", [Role.DEVELOPER, Role.AUDITOR, Role.TENANT_ADMIN])
    gone_member = org.members[Role.DEVELOPER]
    Member.objects.filter(pk=gone_member.pk).update(is_active=False)
    gone_user = org.members[Role.AUDITOR].user
    gone_user.is_active = False
    gone_user.save(update_fields=["is_active"])
    active = org.members[Role.TENANT_ADMIN].user.username
    with client_from(server, "127.0.0.7") as http:
        # When each is tried with its correct password, and the active one with a wrong one
        answers = [password_token(http, gone_member.user.username, PASSWORD),
                   password_token(http, gone_user.username, PASSWORD),
                   password_token(http, active, WRONG)]
        pages = [ui_sign_in(http, gone_member.user.username, PASSWORD),
                 ui_sign_in(http, gone_user.username, PASSWORD),
                 ui_sign_in(http, active, WRONG)]
    # Then all three answers are the same, status and body, on the API and in the UI
    assert {a.status_code for a in answers} == {401}
    assert answers[0].json() == answers[1].json() == answers[2].json()
    assert answers[0].json()["error"]["message"] == "Incorrect username or password."
    assert {p.status_code for p in pages} == {401}
    assert all("Incorrect username or password." in p.text for p in pages)
    assert "No active membership" not in "".join(p.text for p in pages)


class CountingHasher(MD5PasswordHasher):
    """The test settings' hasher, counting the hashes computed (the dear part)."""

    hashes = 0

    def encode(self, password: str, salt: str) -> str:
        CountingHasher.hashes += 1
        return super().encode(password, salt)


@pytest.mark.django_db
def test_every_refused_sign_in_does_the_same_work(settings: Any) -> None:
    # Given a member deactivated, a user deactivated, a disabled tenant, an active one
    settings.PASSWORD_HASHERS = [f"{__name__}.CountingHasher"]
    org: Org = make_org("alice", [Role.DEVELOPER, Role.AUDITOR, Role.TENANT_ADMIN])
    off = make_org("offco", [Role.DEVELOPER])
    off.tenant.is_active = False
    off.tenant.save(update_fields=["is_active"])
    Member.objects.filter(pk=org.members[Role.DEVELOPER].pk).update(is_active=False)
    auditor = org.members[Role.AUDITOR].user
    auditor.is_active = False
    auditor.save(update_fields=["is_active"])
    cases = {
        "unknown user": ("nobody-at-all", PASSWORD),
        "wrong password": (org.members[Role.TENANT_ADMIN].user.username, WRONG),
        "deactivated member, right password": (
            org.members[Role.DEVELOPER].user.username, PASSWORD),
        "deactivated user, right password": (auditor.username, PASSWORD),
        "disabled tenant, right password": (
            off.members[Role.DEVELOPER].user.username, PASSWORD),
    }
    work = {}
    for case, (username, password) in cases.items():
        # When each signs in
        CountingHasher.hashes = 0
        with CaptureQueriesContext(connection) as queries, \
                pytest.raises(Unauthenticated) as refused:
            member_sign_in(username=username, password=password, tenant=None,
                           source="192.0.2.1")
        work[case] = (CountingHasher.hashes, len(queries), refused.value.message)
    # Then each hashed the password once, ran the same queries, and got the same answer
    assert len(set(work.values())) == 1, work
    assert next(iter(work.values()))[0] == 1


# -- where a call comes from ---------------------------------------------------------------
def test_forwarded_for_is_believed_only_from_a_trusted_proxy(settings: Any) -> None:
    settings.SLUICE_TRUSTED_PROXIES = []
    assert throttle.client_source("10.0.0.5", "203.0.113.9") == "10.0.0.5"
    settings.SLUICE_TRUSTED_PROXIES = ["10.0.0.0/8"]
    # the right-most hop that is no trusted proxy; spoofed hops to its left are ignored
    assert throttle.client_source("10.0.0.5", "1.2.3.4, 203.0.113.9, 10.0.0.7") == \
        "203.0.113.9"
    assert throttle.client_source("198.51.100.1", "203.0.113.9") == "198.51.100.1"
    assert throttle.client_source("10.0.0.5", "not-an-address") == "10.0.0.5"
    assert throttle.grpc_source("ipv6:[2001:db8::1]:5000") == "2001:db8::1"
    # one IPv6 subscriber (/64) is one source; an IPv4-mapped address is its IPv4 one
    assert throttle.source_tag("2001:db8::1") == throttle.source_tag("2001:db8::ffff:2")
    assert throttle.source_tag("::ffff:192.0.2.1") == throttle.source_tag("192.0.2.1")
