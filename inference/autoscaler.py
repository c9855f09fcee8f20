"""The autoscaler process (`manage.py autoscale`, started by the run command).

Every tick (0.2 s) it reads, per enabled deployment, the queue depth (queued or
running), the age of the oldest queued request and the live workers' heartbeats from
Redis; `autoscale.Scaler` turns that into a replica count; the driver applies it:

    local  workers are this process's forked children (supervisor.py): started,
           stopped (drained) and replaced when they die; the embedded default
    none   decide and publish only: `sluice_autoscaler_desired_replicas` drives
           Kubernetes through KEDA (platform/deploy/), nothing is started here

One autoscaler acts at a time (a Redis lease, renewed every tick); others wait as hot
standbys. Decisions, restarts and cold starts go to the Redis stream
`sluice:autoscale:events` (the management API and the admin UI list it) and to the
metrics; the live picture per deployment is in the hash `sluice:autoscale:state`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from secrets import token_hex
from typing import Any

import redis

from inference import queue as q
from inference.autoscale import Decision, Observation, ScalePolicy, Scaler
from inference.spec import DeploymentSpec
from inference.supervisor import Supervisor

logger = logging.getLogger("sluice.autoscale")

EVENTS_KEY = "sluice:autoscale:events"
STATE_KEY = "sluice:autoscale:state"
LEADER_KEY = "sluice:autoscale:leader"
EVENTS_MAXLEN = 10_000
COLD_START_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
_LEASE_MS = 5000
_RELOAD_S = 1.0
# A ready worker silent this long is wedged: twice the default reclaim_after_ms, above
# any decode step (its requests are taken over after reclaim_after_ms anyway).
HUNG_AFTER_S = 60.0
_WATCH_GAP_S = 5.0  # ticks further apart than this restart the silence clocks
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0
"""


def cold_start_key(deployment: str) -> str:
    """Hash: histogram bucket upper bound (or "sum", "count") -> value."""
    return q.deployment_key(deployment, "coldstart")


def counts_key() -> str:
    """Hash: "<deployment>|<event kind>" -> how many."""
    return "sluice:autoscale:counts"


@dataclass
class Target:
    spec: DeploymentSpec
    scaler: Scaler
    ready: set[int] = field(default_factory=set)  # pids whose first heartbeat was seen
    beat: dict[int, float] = field(default_factory=dict)  # pid -> last seen live (monotonic)
    watched: float = 0.0  # when the heartbeats were last looked at (monotonic)


def policy_of(deployment: Any) -> ScalePolicy:
    return ScalePolicy(
        min_replicas=deployment.min_replicas, max_replicas=deployment.max_replicas,
        target_inflight=deployment.target_inflight or deployment.max_batch_size,
        up_delay_s=deployment.scale_up_delay_s, down_delay_s=deployment.scale_down_delay_s,
        zero_delay_s=deployment.scale_to_zero_delay_s,
        max_queue_age_s=deployment.max_queue_age_s)


class Autoscaler:
    def __init__(self, client: redis.Redis, redis_url: str, *, driver: str = "local",
                 only: list[str] | None = None, tick_s: float = 0.2,
                 hung_after_s: float = HUNG_AFTER_S) -> None:
        if driver not in ("local", "none"):
            raise ValueError("driver must be 'local' or 'none'")
        self.redis = client
        self.driver = driver
        self.only = set(only or [])
        self.tick_s = tick_s
        self.hung_after_s = hung_after_s
        self.id = f"{socket.gethostname()}-{os.getpid()}-{token_hex(3)}"
        self.supervisor = Supervisor(redis_url)
        self.targets: dict[str, Target] = {}
        self.stopping = threading.Event()
        self.leader = False
        self._renew = client.register_script(_RENEW_LUA)
        self._next_reload = 0.0

    # -- loop ------------------------------------------------------------------------
    def run(self) -> None:
        logger.info("autoscaler %s (driver %s) started", self.id, self.driver)
        try:
            while not self.stopping.is_set():
                began = time.monotonic()
                try:
                    self.tick()
                except redis.RedisError:
                    logger.exception("Redis failed; keeping the current workers")
                    self.stopping.wait(1.0)
                self.stopping.wait(max(0.0, self.tick_s - (time.monotonic() - began)))
        finally:
            self.supervisor.stop_all()
            if self.leader:
                self.redis.delete(LEADER_KEY)

    def tick(self) -> None:
        now = time.monotonic()
        self.leader = bool(self._renew(keys=[LEADER_KEY], args=[self.id, _LEASE_MS]))
        if not self.leader:
            return
        if now >= self._next_reload:
            self._reload()
            self._next_reload = now + _RELOAD_S
        names = list(self.targets)
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.get(q.depth_key(name))
            pipe.hgetall(q.workers_key(name))
            pipe.hkeys(q.streams_key(name))
        replies = pipe.execute()
        for died in self.supervisor.reap():
            self._event(died.deployment, "restart", reason=f"worker pid {died.pid} exited "
                        f"with code {died.code}; replacing it")
        state = {}
        for i, name in enumerate(names):
            raw_depth, beats, suffixes = replies[3 * i: 3 * i + 3]
            live = q.live_heartbeats(beats)
            target = self.targets[name]
            obs = Observation(depth=int(raw_depth or 0),
                              oldest_age_s=self._oldest_age_s(name, suffixes),
                              starting=max(0, target.scaler.replicas - len(live)))
            before = target.scaler.replicas
            decision = target.scaler.decide(obs, now)
            if decision is not None:
                self._decided(name, before, decision, obs)
            self._apply(target, live)
            state[name] = json.dumps({
                "desired": target.scaler.replicas, "live": len(live),
                "running": len(self.supervisor.running(name)) if self.driver == "local"
                else len(live), "depth": obs.depth, "oldest_age_s": round(obs.oldest_age_s, 3),
                "driver": self.driver, "autoscaler": self.id, "ts": time.time()})
        if state:
            self.redis.hset(STATE_KEY, mapping=state)

    # -- pieces --------------------------------------------------------------------
    def _reload(self) -> None:
        from inference.models import Deployment

        rows = Deployment.objects.filter(enabled=True)
        if self.only:
            rows = rows.filter(name__in=self.only)
        seen = set()
        for row in rows:
            seen.add(row.name)
            policy = policy_of(row)
            target = self.targets.get(row.name)
            if target is None:
                self.targets[row.name] = Target(row.to_spec(), Scaler(policy))
            else:
                target.spec = row.to_spec()
                target.scaler.policy = policy
        for name in set(self.targets) - seen:  # disabled or removed: its workers go
            target = self.targets.pop(name)
            if self.driver == "local":
                self.supervisor.scale(target.spec, 0)
            self._event(name, "scale", reason="deployment disabled or removed",
                        **{"from": target.scaler.replicas, "to": 0})

    def _oldest_age_s(self, name: str, suffixes: list[bytes]) -> float:
        if not suffixes:
            return 0.0
        pipe = self.redis.pipeline(transaction=False)
        for suffix in suffixes:
            pipe.xrange(q.stream_key(name, suffix.decode()), count=1)
        return q.oldest_age_ms(pipe.execute()) / 1000

    def _decided(self, name: str, before: int, decision: Decision, obs: Observation) -> None:
        logger.info("%s: %d -> %d worker(s): %s", name, before, decision.replicas,
                    decision.reason)
        self._event(name, "scale", reason=decision.reason, depth=obs.depth,
                    **{"from": before, "to": decision.replicas})

    def _apply(self, target: Target, live: dict[str, dict[str, Any]]) -> None:
        if self.driver != "local":
            return
        loads = {int(b.get("pid", 0)): int(b.get("load", 0)) for b in live.values()}
        self._kill_hung(target, loads)
        self.supervisor.scale(target.spec, target.scaler.replicas, idle_first=loads)
        # Cold start: from fork to the first heartbeat (the model is loaded by then).
        for proc in self.supervisor.running(target.spec.name):
            if proc.pid in loads and proc.pid not in target.ready:
                target.ready.add(proc.pid)
                seconds = time.monotonic() - proc.started
                self._cold_start(target.spec.name, proc.pid, seconds)
        alive = {p.pid for p in self.supervisor.running(target.spec.name)}
        target.ready &= alive
        target.beat = {pid: at for pid, at in target.beat.items() if pid in alive}

    def _kill_hung(self, target: Target, loads: dict[int, int]) -> None:
        """A worker that was ready and then sent no heartbeat for hung_after_s is wedged
        (a device hang, a deadlock): alive, holding a replica's place, serving nothing.
        It is killed (SIGKILL: its own handlers may never run) and replaced; the
        requests it held were taken over by then (after reclaim_after_ms, 30 s)."""
        now = time.monotonic()
        running = self.supervisor.running(target.spec.name)
        if now - target.watched > max(_WATCH_GAP_S, 5 * self.tick_s):
            # Nobody was looking (Redis was down: the workers could not beat either;
            # another autoscaler led): silence counts from now.
            target.beat = {proc.pid: now for proc in running}
        target.watched = now
        for pid in loads:
            target.beat[pid] = now
        for proc in running:
            silent = now - target.beat.get(proc.pid, now)
            if proc.pid in target.ready and silent > self.hung_after_s:
                self.supervisor.kill(proc)
                self._event(target.spec.name, "restart", reason=f"worker pid {proc.pid} "
                            f"sent no heartbeat for {silent:.0f}s (hung); killed, replacing it")

    def _cold_start(self, name: str, pid: int, seconds: float) -> None:
        pipe = self.redis.pipeline(transaction=False)
        key = cold_start_key(name)
        for bound in COLD_START_BUCKETS:
            if seconds <= bound:
                pipe.hincrby(key, str(bound), 1)
        pipe.hincrbyfloat(key, "sum", seconds)
        pipe.hincrby(key, "count", 1)
        pipe.execute()
        self._event(name, "ready", reason=f"worker pid {pid} ready after a {seconds:.2f}s "
                    "cold start", cold_start_s=round(seconds, 3))

    def _event(self, name: str, kind: str, *, reason: str, **extra: Any) -> None:
        fields = {"ts": f"{time.time():.3f}", "deployment": name, "kind": kind,
                  "reason": reason, "autoscaler": self.id,
                  **{k: str(v) for k, v in extra.items()}}
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(EVENTS_KEY, fields, maxlen=EVENTS_MAXLEN, approximate=True)
        pipe.hincrby(counts_key(), f"{name}|{kind}", 1)
        pipe.execute()


def events(client: redis.Redis, *, deployment: str | None = None,
           limit: int = 100) -> list[dict[str, Any]]:
    """Newest first; `deployment` filters."""
    out: list[dict[str, Any]] = []
    last = "+"
    while len(out) < limit:
        batch = client.xrevrange(EVENTS_KEY, max=last, count=500)
        for entry_id, raw in batch:
            fields = {k.decode(): v.decode() for k, v in raw.items()}
            if deployment is None or fields.get("deployment") == deployment:
                out.append({"id": entry_id.decode(), **fields})
        if len(batch) < 500:
            break
        last = "(" + batch[-1][0].decode()
    return out[:limit]


def state(client: redis.Redis) -> dict[str, dict[str, Any]]:
    return {k.decode(): json.loads(v) for k, v in client.hgetall(STATE_KEY).items()}
