from __future__ import annotations

from django.urls import include, path

from sluice import health
from sluice.errors import BadRequest, NotFound, ServerError
from sluice.responses import error_response
from sluice.root.api import api
from tenants import views as tenant_views

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path(".well-known/jwks.json", tenant_views.jwks, name="jwks"),
    path(".well-known/openid-configuration", tenant_views.openid_configuration,
         name="openid-configuration"),
    path("ui/", include("frontend.urls")),
    path("", api.urls),
]


def handler404(request, exception=None):
    return error_response(NotFound("No route matches this path."))


def handler500(request):
    return error_response(ServerError("The server had an error processing your request."))


def handler400(request, exception=None):
    return error_response(BadRequest("Bad request."))
