"""WebSocket routes (the realtime chat socket arrives with the gRPC/WebSocket issue)."""

from __future__ import annotations

from typing import Any

websocket_urlpatterns: list[Any] = []
