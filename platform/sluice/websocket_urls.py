"""WebSocket routes."""

from __future__ import annotations

from typing import Any

from django.urls import path

from streaming.consumers import RealtimeConsumer

websocket_urlpatterns: list[Any] = [
    path("v1/realtime", RealtimeConsumer.as_asgi()),
]
