"""Channels: the WebSocket layer rides on the same Redis."""

from __future__ import annotations

from sluice.settings.redis import CHANNELS_REDIS_URL, REDIS_SOCKET_TIMEOUT_S

# A receive on the layer is a BZPOPMIN that blocks up to channels_redis's
# RedisChannelLayer.brpop_timeout (5 s), then loops. With redis-py's default socket
# timeout (also 5 s) an idle receive timed its own read out and raised, ending its
# consumer: the layer's reads wait the block plus our usual Redis timeout, so a dead
# Redis is still noticed.
_LAYER_BLOCK_S = 5

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [{
            "address": CHANNELS_REDIS_URL,  # a single Redis (SLUICE_CHANNELS_REDIS_URL)
            "socket_timeout": _LAYER_BLOCK_S + REDIS_SOCKET_TIMEOUT_S,
            "socket_connect_timeout": REDIS_SOCKET_TIMEOUT_S,
        }], "prefix": "sluice:channels"},
    }
}
