"""Channels: the WebSocket layer rides on the same Redis."""

from __future__ import annotations

from sluice.settings.redis import REDIS_URL

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL], "prefix": "sluice:channels"},
    }
}
