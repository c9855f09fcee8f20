"""TLS and HTTP versions at the edge (docs/TLS.md): what the run command's HTTP server and
the gRPC server terminate.

A certificate and its key are files (a mounted Kubernetes TLS secret is two files): both
or neither. The gRPC server uses the HTTP server's pair unless given its own.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from sluice.settings.env import env_str

HTTP_VERSIONS = ("auto", "1", "2")


def _pair(cert_name: str, key_name: str, cert_default: str = "",
          key_default: str = "") -> tuple[str, str]:
    cert, key = env_str(cert_name, cert_default).strip(), env_str(key_name, key_default).strip()
    if bool(cert) != bool(key):
        raise ImproperlyConfigured(f"{cert_name} and {key_name} go together: set both or "
                                   "neither")
    return cert, key


SLUICE_TLS_CERT_FILE, SLUICE_TLS_KEY_FILE = _pair("SLUICE_TLS_CERT_FILE",
                                                  "SLUICE_TLS_KEY_FILE")
SLUICE_GRPC_TLS_CERT_FILE, SLUICE_GRPC_TLS_KEY_FILE = _pair(
    "SLUICE_GRPC_TLS_CERT_FILE", "SLUICE_GRPC_TLS_KEY_FILE", SLUICE_TLS_CERT_FILE,
    SLUICE_TLS_KEY_FILE)
# auto: HTTP/1.1 and HTTP/2 where the server speaks it (h2 by ALPN over TLS, h2c by prior
# knowledge without); 1: HTTP/1.1 only; 2: HTTP/2 only (no WebSocket: it needs HTTP/1.1).
SLUICE_HTTP_VERSION = env_str("SLUICE_HTTP_VERSION", "auto").strip().lower()
if SLUICE_HTTP_VERSION not in HTTP_VERSIONS:
    raise ImproperlyConfigured(f"SLUICE_HTTP_VERSION must be one of {', '.join(HTTP_VERSIONS)}"
                               f", got {SLUICE_HTTP_VERSION!r}")
