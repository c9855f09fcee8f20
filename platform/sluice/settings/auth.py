"""Identity: the platform's own JWT issuer and the external OIDC issuers it trusts."""

from __future__ import annotations

import ipaddress

from django.core.exceptions import ImproperlyConfigured

from sluice.settings.env import env_int, env_json, env_list, env_str

# The platform signs its own access tokens. Keys live as PEM files in this directory
# (one per kid, newest is active); `manage.py rotatejwtkeys` adds one and prunes old ones.
SLUICE_JWT_KEYS_DIR = env_str("SLUICE_JWT_KEYS_DIR", "")  # empty: <state dir>/jwt_keys
SLUICE_JWT_SIGNING_ALG = env_str("SLUICE_JWT_SIGNING_ALG", "ES256")
# Algorithms accepted on verification (RFC 8725 §3.1: an explicit allow-list).
SLUICE_JWT_ALGORITHMS = env_list("SLUICE_JWT_ALGORITHMS", ["ES256", "RS256"])
SLUICE_JWT_ISSUER = env_str("SLUICE_JWT_ISSUER", "")  # empty: PUBLIC_URL
SLUICE_JWT_AUDIENCE = env_str("SLUICE_JWT_AUDIENCE", "sluice-api")
SLUICE_JWT_ACCESS_TTL_S = env_int("SLUICE_JWT_ACCESS_TTL_S", 900, minimum=30)
SLUICE_JWT_LEEWAY_S = env_int("SLUICE_JWT_LEEWAY_S", 30, minimum=0)

# External OIDC issuers (e.g. Azure AD): a JSON list of objects, see docs/CONFIGURATION.md.
SLUICE_OIDC_ISSUERS = env_json("SLUICE_OIDC_ISSUERS", [])

# The lean inference path caches principals this long (revocation latency there).
SLUICE_AUTH_CACHE_TTL_S = env_int("SLUICE_AUTH_CACHE_TTL_S", 10, minimum=0)

# Credential guessing (tenants/throttle.py): wrong passwords counted per source on a
# username (ACCOUNT_FAILURES), per username in distinct failing sources (ACCOUNT_SOURCES;
# sources that signed in to it within KNOWN_SOURCE_S are not bound by that lock) and
# per source (SOURCE_FAILURES, wrong API keys too). Past a threshold each failure locks
# for BACKOFF_S x 2^(failures - threshold), at most BACKOFF_MAX_S; failures are forgotten
# FAILURE_WINDOW_S after the last one. A refused attempt does not count, so no lock
# outlasts BACKOFF_MAX_S.
SLUICE_AUTH_FAILURE_WINDOW_S = env_int("SLUICE_AUTH_FAILURE_WINDOW_S", 900, minimum=1)
SLUICE_AUTH_ACCOUNT_FAILURES = env_int("SLUICE_AUTH_ACCOUNT_FAILURES", 5, minimum=1)
SLUICE_AUTH_ACCOUNT_SOURCES = env_int("SLUICE_AUTH_ACCOUNT_SOURCES", 5, minimum=1)
SLUICE_AUTH_KNOWN_SOURCE_S = env_int("SLUICE_AUTH_KNOWN_SOURCE_S", 30 * 86400, minimum=1)
SLUICE_AUTH_SOURCE_FAILURES = env_int("SLUICE_AUTH_SOURCE_FAILURES", 30, minimum=1)
SLUICE_AUTH_BACKOFF_S = env_int("SLUICE_AUTH_BACKOFF_S", 1, minimum=1)
SLUICE_AUTH_BACKOFF_MAX_S = env_int("SLUICE_AUTH_BACKOFF_MAX_S", 300, minimum=1)
# Proxies whose X-Forwarded-For is believed (comma-separated CIDRs); none by default, so
# a client cannot pick the address it is counted under.
SLUICE_TRUSTED_PROXIES = env_list("SLUICE_TRUSTED_PROXIES", [])
for _cidr in SLUICE_TRUSTED_PROXIES:
    try:
        ipaddress.ip_network(_cidr, strict=False)
    except ValueError:
        raise ImproperlyConfigured(f"SLUICE_TRUSTED_PROXIES: {_cidr!r} is no CIDR") from None
