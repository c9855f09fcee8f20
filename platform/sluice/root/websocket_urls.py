"""WebSocket routes."""

from __future__ import annotations

from typing import Any

from django.urls import path

from streaming.transports.realtime_refusal import OpenAIRealtimePath
from streaming.transports.websocket import RealtimeConsumer

chat_socket = RealtimeConsumer.as_asgi()
# ASGI apps, which Channels' URLRouter routes (django-stubs types path() for views).
realtime_path: Any = OpenAIRealtimePath(chat_socket)

websocket_urlpatterns: list[Any] = [
    path("v1/chat/socket", chat_socket),
    # OpenAI's Realtime API path (our socket's first home): a Realtime client is told
    # this server does not speak that API; our own clients are still served there.
    path("v1/realtime", realtime_path),
]
