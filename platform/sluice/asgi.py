"""The one ASGI application: HTTP (Django) and WebSocket (Channels) by protocol.

Any ASGI server can serve it (uvicorn is what the run command uses; daphne works too).
"""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sluice.settings.base")

from django.core.asgi import get_asgi_application

django_http = get_asgi_application()  # sets Django up before the imports below

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from sluice.websocket_urls import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter({
    "http": django_http,
    "websocket": AllowedHostsOriginValidator(URLRouter(websocket_urlpatterns)),
})
