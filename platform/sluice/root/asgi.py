"""The one ASGI application: HTTP (the lean /v1 inference path, else Django) and
WebSocket (Channels) by protocol.

Any ASGI server can serve it (uvicorn is what the run command uses; granian and daphne
work too: platform/sluice/servers.py).
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sluice.settings.base")

from django.core.asgi import get_asgi_application

django_http = get_asgi_application()  # sets Django up before the imports below

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from governance.cluster_metrics import ClusterCollector  # noqa: E402
from sluice import gctuning  # noqa: E402
from sluice.bodylimit import BodyLimit  # noqa: E402
from sluice.observability import metrics, telemetry  # noqa: E402
from sluice.root.websocket_urls import websocket_urlpatterns  # noqa: E402
from streaming.transports.asgi import LeanApp  # noqa: E402

telemetry.setup("sluice-api")
metrics.add_collector(ClusterCollector())  # /metrics shows the cluster's state too
lean = LeanApp()
# Django reads a whole body before its middleware runs: the limits go in front of it.
django_guarded = BodyLimit(django_http)
gctuning.tune()  # everything above lives as long as the process (sluice/gctuning.py)


async def http(scope: Any, receive: Any, send: Any) -> None:
    """The /v1 inference routes take the lean path (which limits its own bodies),
    /metrics is Prometheus's; everything else is Django, behind the body limits
    (sluice/bodylimit.py)."""
    if lean.handles(scope["path"]):
        await lean(scope, receive, send)
    elif scope["path"] == "/metrics":
        await metrics.serve(scope, receive, send)
    else:
        await django_guarded(scope, receive, send)


sockets = URLRouter(websocket_urlpatterns)
browser_sockets = AllowedHostsOriginValidator(sockets)


async def websocket(scope: Any, receive: Any, send: Any) -> None:
    """Browsers send an Origin: it must be one of ours. SDKs and servers send none, and
    authenticate with a bearer token rather than cookies, so there is no cross-site
    session to hijack."""
    if any(name == b"origin" for name, _ in scope.get("headers", [])):
        await browser_sockets(scope, receive, send)
    else:
        await sockets(scope, receive, send)


protocols = ProtocolTypeRouter({"http": http, "websocket": websocket})


async def lifespan(receive: Any, send: Any) -> None:
    """ASGI lifespan: on shutdown, settle open calls and write the governance counters
    still held in this process (see governance/recorder.py)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await lean.gateway.close()
            telemetry.shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return


async def application(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
    else:
        await protocols(scope, receive, send)
