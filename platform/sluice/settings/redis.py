"""Redis: the queue, limits, quotas, breakers, caches and streams (REDIS_URL, a single
Redis or a Redis Cluster); Celery's broker and the Channels layer, which cannot use a
cluster, on a single Redis of their own when REDIS_URL is one."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from sluice.settings.env import env_int, env_str

# redis://host:port/db, rediss://... (TLS), or a cluster's seed nodes:
# redis+cluster://[user:password@]host:port,host:port/ (rediss+cluster:// with TLS).
REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS_SOCKET_TIMEOUT_S = env_int("SLUICE_REDIS_TIMEOUT_MS", 2000, minimum=1) / 1000
# How long a command to a cluster keeps retrying through a failover (connection errors,
# CLUSTERDOWN, each try after a topology refresh) before it fails retriably.
REDIS_CLUSTER_RETRY_S = env_int("SLUICE_REDIS_CLUSTER_RETRY_MS", 5000, minimum=0) / 1000


def _single_redis_url(name: str, default: str | None) -> str:
    """A URL for a component that needs one Redis server (Celery's broker and results,
    the Channels layer): `name` from the environment, else `default`."""
    from sluice.redis import is_cluster_url

    value = env_str(name, "").strip() or default
    if not value:
        raise ImproperlyConfigured(
            f"REDIS_URL is a Redis Cluster, which Celery and the Channels layer cannot use: "
            f"set {name} to a single Redis (redis://host:port/db)")
    if is_cluster_url(value):
        raise ImproperlyConfigured(f"{name} must be a single Redis (redis:// or rediss://), "
                                   f"not a cluster")
    return value


def _checked(url: str) -> bool:
    """Whether REDIS_URL is a cluster URL (ImproperlyConfigured if a malformed one)."""
    from sluice.redis import cluster_seeds, is_cluster_url

    if not is_cluster_url(url):
        return False
    try:
        cluster_seeds(url)
    except ValueError as exc:
        raise ImproperlyConfigured(f"REDIS_URL: {exc}") from None
    return True


REDIS_IS_CLUSTER = _checked(REDIS_URL)
# Celery's broker and result backend; the Channels layer (by default the same server).
CELERY_REDIS_URL = _single_redis_url("SLUICE_CELERY_REDIS_URL",
                                     None if REDIS_IS_CLUSTER else REDIS_URL)
CHANNELS_REDIS_URL = _single_redis_url("SLUICE_CHANNELS_REDIS_URL", CELERY_REDIS_URL)
