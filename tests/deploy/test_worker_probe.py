"""The worker pod's liveness probe (platform/deploy/probes/worker_alive.py), run as the
kubelet runs it, against the test Redis: it fails only when this host's worker has
stopped beating, never for another host's worker, before the first beat, or because
Redis is away."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from django.conf import settings

from inference import queue as q
from sluice.localinfra import free_port
from sluice.redis import sync_redis
from tests.conftest import REPO

DEPLOYMENT = f"probed-{os.getpid()}"


def probe(redis_url: str | None = None) -> int:
    env = {**os.environ, "REDIS_URL": redis_url or settings.REDIS_URL,
           "DJANGO_SETTINGS_MODULE": "sluice.settings.base"}
    return subprocess.run(
        [sys.executable, "platform/deploy/probes/worker_alive.py", "--deployment",
         DEPLOYMENT, "--stale-after", "60"], cwd=REPO, env=env, timeout=60).returncode


def beat(host: str, age_s: float) -> None:
    sync_redis().hset(q.workers_key(DEPLOYMENT), f"{host}-4242-abcdef",
                      json.dumps({"ts": time.time() - age_s, "pid": 4242}))


def test_the_probe_fails_only_on_this_hosts_silent_worker() -> None:
    here = socket.gethostname()
    sync_redis().delete(q.workers_key(DEPLOYMENT))
    try:
        assert probe() == 0  # loading its model: no beat yet
        beat("another-pod", age_s=600)
        assert probe() == 0  # someone else's silence
        beat(here, age_s=1)
        assert probe() == 0
        beat(here, age_s=120)
        assert probe() == 1  # wedged: restart it
        assert probe(f"redis://127.0.0.1:{free_port()}/0") == 0  # Redis away: not its fault
    finally:
        sync_redis().delete(q.workers_key(DEPLOYMENT))
