"""The admin UI's response headers: a strict Content-Security-Policy on every /ui/ page
(none on the API's docs page, which loads Swagger from a CDN), and cookies that are
Secure exactly when the request came in over HTTPS, directly or through a proxy whose
X-Forwarded-Proto is trusted. The browser side (nothing the UI needs is blocked) is in
test_csp_browser.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import pytest
from django.test import Client

from tenants.roles import Role
from tests.conftest import PASSWORD, REPO, Org

pytestmark = pytest.mark.django_db

DIRECTIVES = {"default-src 'self'", "script-src 'self'", "style-src 'self'",
              "object-src 'none'", "base-uri 'none'", "frame-ancestors 'none'",
              "form-action 'self'"}

# What a strict policy blocks: inline styles and event handlers, javascript: URLs.
INLINE = re.compile(r"<style\b|\sstyle\s*=|\son[a-z]+\s*=|javascript:", re.IGNORECASE)


def directives(header: str) -> set[str]:
    return {d.strip() for d in header.split(";") if d.strip()}


def sign_in(client: Client, org: Org, role: Role, **extra: str) -> dict[str, dict[str, str]]:
    """Sign in through the login form; the cookies set on the way, with attributes."""
    seen: dict[str, dict[str, str]] = {}
    for response in (client.get("/ui/login", **extra),  # type: ignore[arg-type]
                     client.post("/ui/login", {"username": f"{org.tenant.slug}-{role}",
                                               "password": PASSWORD}, **extra)):  # type: ignore[arg-type]
        for name, morsel in response.cookies.items():
            seen[name] = {"secure": str(morsel["secure"]), "httponly": str(morsel["httponly"])}
    assert response.status_code == 302, response.content[:300]
    return seen


def test_every_ui_page_carries_a_strict_csp_and_no_inline_script(alice: Org) -> None:
    # Given a signed-in tenant admin
    client = Client()
    sign_in(client, alice, Role.TENANT_ADMIN)
    pages = ["/ui/login", "/ui/dashboard", "/ui/limits", "/ui/limits/new", "/ui/keys",
             "/ui/audit", "/ui/members", "/ui/quotas", "/ui/limits/999999999",
             "/ui/static/app.js"]
    for url in pages:
        # When a page is served
        response = client.get(url)
        # Then it carries the policy, and the HTML has nothing the policy would block
        policy = directives(response.get("Content-Security-Policy", ""))
        assert policy >= DIRECTIVES, (url, policy)
        assert not any("unsafe" in d for d in policy), policy
        assert response["X-Content-Type-Options"] == "nosniff"
        assert response["Referrer-Policy"] == "same-origin"
        assert response["X-Frame-Options"] == "DENY"
        if response["Content-Type"].startswith("text/html"):
            html = response.content.decode()
            for tag in re.findall(r"<script\b[^>]*>", html):
                assert "src=" in tag or 'type="application/json"' in tag, (url, tag)
            assert not INLINE.search(html), (url, INLINE.search(html))


def test_the_api_docs_page_keeps_its_cdn_assets() -> None:
    response = Client().get("/api/docs")
    assert response.status_code == 200
    assert "Content-Security-Policy" not in response


def test_cookies_over_plain_http_are_not_secure(alice: Org) -> None:
    # Given the dev server's plain HTTP, When someone signs in
    cookies = sign_in(Client(), alice, Role.DEVELOPER)
    # Then the session and CSRF cookies come back without Secure (the browser would
    # not send them back over HTTP otherwise), HttpOnly for the session
    assert {"sessionid", "csrftoken"} <= set(cookies)
    assert cookies["sessionid"]["secure"] == "" and cookies["csrftoken"]["secure"] == ""
    assert cookies["sessionid"]["httponly"] == "True"


def test_cookies_over_https_are_secure(alice: Org) -> None:
    # Given a request that reached us over TLS directly, When someone signs in
    cookies = sign_in(Client(), alice, Role.DEVELOPER, secure=True)  # type: ignore[arg-type]
    # Then every cookie is Secure
    assert {"sessionid", "csrftoken"} <= set(cookies)
    assert all(c["secure"] == "True" for c in cookies.values()), cookies


def test_cookies_behind_a_trusted_https_proxy_are_secure(alice: Org,
                                                         settings: Any) -> None:
    # Given a TLS-terminating proxy whose X-Forwarded-Proto we trust
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    # When someone signs in through it over HTTPS
    cookies = sign_in(Client(), alice, Role.DEVELOPER, HTTP_X_FORWARDED_PROTO="https")
    # Then every cookie is Secure
    assert {"sessionid", "csrftoken"} <= set(cookies)
    assert all(c["secure"] == "True" for c in cookies.values()), cookies
    # and the same proxy forwarding plain HTTP gets cookies without Secure
    plain = sign_in(Client(), alice, Role.DEVELOPER, HTTP_X_FORWARDED_PROTO="http")
    assert all(c["secure"] == "" for c in plain.values()), plain


def test_an_untrusted_forwarded_proto_does_not_count_as_https(alice: Org) -> None:
    # Given no trust setting, When a client claims https in the header itself
    cookies = sign_in(Client(), alice, Role.DEVELOPER, HTTP_X_FORWARDED_PROTO="https")
    # Then it is plain HTTP still
    assert all(c["secure"] == "" for c in cookies.values()), cookies


@pytest.mark.parametrize(("env", "expected"), [
    ({}, "None False"),
    ({"SLUICE_TRUST_X_FORWARDED_PROTO": "true"},
     "('HTTP_X_FORWARDED_PROTO', 'https') False"),
    ({"SLUICE_PUBLIC_URL": "https://api.example.com"}, "None True"),
    ({"SLUICE_PUBLIC_URL": "https://api.example.com", "SLUICE_SECURE_COOKIES": "false"},
     "None False"),
])
def test_the_environment_sets_the_proxy_trust_and_forced_secure_cookies(
        env: dict[str, str], expected: str) -> None:
    # Given the settings as a fresh process reads them from its environment
    base = {k: v for k, v in os.environ.items()
            if k not in ("SLUICE_TRUST_X_FORWARDED_PROTO", "SLUICE_PUBLIC_URL",
                         "SLUICE_SECURE_COOKIES")}
    code = ("import django; django.setup(); from django.conf import settings as s; "
            "print(getattr(s, 'SECURE_PROXY_SSL_HEADER', None), s.SESSION_COOKIE_SECURE "
            "and s.CSRF_COOKIE_SECURE)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True,
                         env={**base, **env, "DJANGO_SETTINGS_MODULE": "sluice.settings.base",
                              "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])})
    # Then the trust and the forced flag are exactly what the variables say
    assert out.stdout.strip().splitlines()[-1] == expected, out.stderr[-2000:]
