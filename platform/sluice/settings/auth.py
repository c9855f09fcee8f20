"""Identity: the platform's own JWT issuer and the external OIDC issuers it trusts."""

from __future__ import annotations

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
