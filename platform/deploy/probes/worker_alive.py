"""Liveness of a model worker's pod: `python platform/deploy/probes/worker_alive.py
--deployment NAME [--stale-after S]`.

Exit 1 when this pod's worker has stopped beating (alive but wedged: a device hang, a
deadlock), so that the kubelet restarts it, as the local autoscaler kills a hung worker
(inference/autoscaler.py HUNG_AFTER_S); exit 0 otherwise. A worker id starts with its
host name, which in a pod is the pod's name. Redis not answering is not this pod's
fault: the probe passes, or every worker would be restarted by one Redis outage. Before
its first beat (loading the model) there is nothing to judge: it passes.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sluice.settings.base")


def stale(beats: dict[bytes, bytes], host: str, now: float, after_s: float) -> bool:
    """True when this host has a worker and none of its beats is fresher than after_s."""
    import json

    mine = [json.loads(v) for k, v in beats.items() if k.decode().startswith(f"{host}-")]
    return bool(mine) and all(now - float(b.get("ts", 0)) > after_s for b in mine)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deployment", required=True)
    parser.add_argument("--stale-after", type=float, default=60.0)
    args = parser.parse_args(argv)
    import redis

    from inference import queue as q
    from sluice.redis import sync_redis

    try:
        beats = sync_redis().hgetall(q.workers_key(args.deployment))
    except redis.RedisError:
        return 0
    return 1 if stale(beats, socket.gethostname(), time.time(), args.stale_after) else 0


if __name__ == "__main__":
    sys.exit(main())
