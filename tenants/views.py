"""Discovery documents for the platform's own issuer."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from sluice.responses import json_response
from tenants.signing_keys import keyring


def jwks(request: HttpRequest) -> HttpResponse:
    response = json_response(keyring().jwks())
    # Short cache: a rotation must reach verifiers well within the access-token lifetime.
    response["Cache-Control"] = "public, max-age=300"
    return response


def openid_configuration(request: HttpRequest) -> HttpResponse:
    base = settings.PUBLIC_URL
    return json_response({
        "issuer": settings.SLUICE_JWT_ISSUER,
        "jwks_uri": f"{base}/.well-known/jwks.json",
        "token_endpoint": f"{base}/v1/auth/token",
        "id_token_signing_alg_values_supported": [settings.SLUICE_JWT_SIGNING_ALG],
        "response_types_supported": ["token"],
        "subject_types_supported": ["public"],
    })
