"""The SSRF guard: which upstream URLs and addresses Sluice may send calls to.

Why: LiteLLM's CVE-2024-6587 let any caller point the proxy at an address of its
choosing (a request's `api_base`), so the proxy fetched cloud metadata and internal
services with its own network position and credentials. Sluice closes that path in
three places:
- nothing a caller sends chooses an upstream: the /v1 request schemas refuse unknown
  fields (`api_base`, `base_url`: a 400), and the upstream of a deployment comes from
  the registry only;
- only platform admins write an upstream URL (inference/services.py checks the actor),
  and `validate_url` below refuses what is not a plain http(s) URL to an allowed host;
- every connection is checked again when it is opened (`check_host`, used by the
  client's network backend), so a name that resolved to an allowed address when it was
  saved and resolves to a forbidden one later (DNS rebinding) is refused.

Addresses:
- always refused: link-local and cloud metadata (169.254.0.0/16 incl. 169.254.169.254,
  fe80::/10, fd00:ec2::254, 100.100.100.200), unspecified (0.0.0.0, ::), multicast,
  broadcast and reserved ranges;
- refused unless the operator allows private upstreams (SLUICE_UPSTREAM_ALLOW_PRIVATE):
  loopback, RFC 1918, carrier-grade NAT (100.64.0.0/10), IPv6 unique-local. A vLLM
  server usually sits on a private network, so most installs set it; it is what lets a
  caller-controlled URL reach internal services, which is why it is off by default.
An IPv6 address that carries an IPv4 one (mapped, NAT64, 6to4, Teredo) is judged as the
IPv4 address it reaches.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

from django.conf import settings

from sluice.settings.env import env_bool

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]
MAX_URL_LENGTH = 2000

# Metadata services outside 169.254.0.0/16 / fe80::/10 (AWS's IPv6 one, Alibaba's).
_METADATA = (ipaddress.ip_network("fd00:ec2::254/128"),
             ipaddress.ip_network("100.100.100.200/32"))
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class UpstreamURLError(ValueError):
    """A URL or address the guard refuses; the message says why (no secret in it: URLs
    with credentials are refused before anything quotes them)."""


def allow_private() -> bool:
    """The operator's choice (SLUICE_UPSTREAM_ALLOW_PRIVATE, a Django setting or the
    environment variable): may upstreams be on loopback or private networks?"""
    configured = getattr(settings, "SLUICE_UPSTREAM_ALLOW_PRIVATE", None)
    if configured is not None:
        return bool(configured)
    return env_bool("SLUICE_UPSTREAM_ALLOW_PRIVATE", False)


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries to the IPv4 network (mapped, NAT64, 6to4,
    Teredo), which is where a connection to it ends up."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    return ip.teredo[1] if ip.teredo is not None else None


def address_refusal(ip: IPAddress, *, private_ok: bool) -> str | None:
    """Why `ip` may not be an upstream's address, or None when it may."""
    if isinstance(ip, ipaddress.IPv6Address):
        ip = _embedded_ipv4(ip) or ip
    if ip.is_link_local or any(ip in net for net in _METADATA):
        return "a link-local or cloud metadata address"
    if ip.is_unspecified or ip.is_multicast or ip in _THIS_NETWORK:
        return "not a unicast address"
    if ip.is_loopback or ip in _CGNAT or (ip.is_private and not ip.is_reserved):
        return None if private_ok else (
            "a loopback or private address (SLUICE_UPSTREAM_ALLOW_PRIVATE=true allows it)")
    if ip.is_reserved or not ip.is_global:
        return "a reserved address"
    return None


def _resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def check_addresses(host: str, addresses: list[str], *, private_ok: bool) -> None:
    """UpstreamURLError unless every address `host` resolved to is allowed (one
    forbidden answer among several is enough to refuse: the attacker picks which one
    a connection uses)."""
    if not addresses:
        raise UpstreamURLError(f"The host '{host}' does not resolve.")
    for raw in addresses:
        reason = address_refusal(ipaddress.ip_address(raw.split("%", 1)[0]),
                                 private_ok=private_ok)
        if reason is not None:
            raise UpstreamURLError(f"The host '{host}' resolves to {reason}.")


def check_host(host: str, port: int, *, private_ok: bool,
               resolve: Resolver = _resolve) -> list[str]:
    """The addresses of `host`, all allowed; UpstreamURLError otherwise."""
    try:
        addresses = resolve(host, port)
    except (OSError, UnicodeError):
        raise UpstreamURLError(f"The host '{host}' does not resolve.") from None
    check_addresses(host, addresses, private_ok=private_ok)
    return addresses


def validate_url(raw: str, *, private_ok: bool | None = None,
                 resolve: Resolver = _resolve) -> str:
    """`raw` as the base URL to store (no trailing slash), or UpstreamURLError: http or
    https only, a host that resolves to allowed addresses only, no user name or
    password, no query and no fragment (credentials belong in the write-only secret,
    never in a URL that pages and logs show)."""
    ok = allow_private() if private_ok is None else private_ok
    if not raw or len(raw) > MAX_URL_LENGTH or any(c.isspace() or ord(c) < 32 for c in raw):
        raise UpstreamURLError(f"Give an http(s) URL of at most {MAX_URL_LENGTH} characters, "
                               "without spaces or control characters.")
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError:
        raise UpstreamURLError("The URL cannot be parsed (check the host and port).") from None
    if parts.scheme not in ("http", "https"):
        raise UpstreamURLError("Only http and https upstream URLs are allowed.")
    if "@" in parts.netloc:
        # Said without quoting the URL: its user-info part may hold a password.
        raise UpstreamURLError("The URL must not carry a user name or password; set the "
                               "upstream's API key as its secret instead.")
    if parts.query or parts.fragment or raw.endswith(("?", "#")):
        raise UpstreamURLError("The URL must not have a query string or a fragment.")
    host = parts.hostname
    if not host:
        raise UpstreamURLError("The URL has no host.")
    check_host(host, port or (443 if parts.scheme == "https" else 80), private_ok=ok,
               resolve=resolve)
    return urlunsplit((parts.scheme, parts.netloc.lower(), parts.path.rstrip("/"), "", ""))
