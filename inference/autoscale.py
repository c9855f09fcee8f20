"""Autoscaling decisions: how many workers a deployment should run, from what Redis
says about its demand. Pure logic (no processes, no I/O): `Scaler.decide` takes an
observation and a clock, so every rule is testable without waiting.

    demand      requests queued or running (the deployment's depth counter)
    raw         ceil(demand / target in-flight per worker), one more when the oldest
                request has waited longer than max_queue_age_s while every worker
                counted is ready (a queue that ages during a cold start says nothing
                about whether the workers keep up: they are not serving yet), within
                [min, max]
    scale up    to the lowest raw of the last up_delay_s (demand must last that long);
                from zero at once: a waiting request must not wait for a delay
    scale down  to the highest raw of the last down_delay_s (a dip must last that long),
                never below one worker until demand has been zero for zero_delay_s
                (two-stage: the last worker goes only after the longer delay)

Both delays are stabilization windows, as Kubernetes' HPA uses: a load that hovers at
a threshold does not make the count flap, since a change needs the whole window to
agree. The window is wall-clock time, not a number of observations: each observation
holds until the next one, so the one taken before the window opened counts too. A
starved loop that observes once after a long pause decides on what held over the whole
window, not on that one reading.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScalePolicy:
    min_replicas: int = 1
    max_replicas: int = 1
    target_inflight: int = 8  # requests per worker the scaler aims for
    up_delay_s: float = 1.0
    down_delay_s: float = 30.0
    zero_delay_s: float = 300.0
    max_queue_age_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 0 <= min_replicas <= max_replicas")
        if self.target_inflight < 1:
            raise ValueError("target_inflight must be at least 1")


@dataclass(frozen=True)
class Observation:
    depth: int  # queued or running
    oldest_age_s: float  # of the oldest queued request (0 when none)
    starting: int = 0  # workers counted in the replicas that are not ready yet


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str


@dataclass
class Scaler:
    """One deployment's scaling state: its recent recommendations and idle time."""

    policy: ScalePolicy
    replicas: int = 0
    history: deque[tuple[float, int]] = field(default_factory=deque)
    idle_since: float | None = None
    started_at: float | None = None

    def raw(self, obs: Observation) -> int:
        """The count this observation alone asks for."""
        p = self.policy
        want = math.ceil(obs.depth / p.target_inflight) if obs.depth > 0 else 0
        if obs.depth > 0 and obs.oldest_age_s > p.max_queue_age_s and obs.starting <= 0:
            want = max(want, self.replicas + 1)  # ready and not keeping up: one more
        return max(p.min_replicas, min(p.max_replicas, want))

    def decide(self, obs: Observation, now: float) -> Decision | None:
        """The new replica count and why, or None to keep the current one."""
        p = self.policy
        if self.started_at is None:
            self.started_at = now
        raw = self.raw(obs)
        self.history.append((now, raw))
        keep = max(p.up_delay_s, p.down_delay_s)
        # The newest observation at or before the longest window's start still holds there.
        while len(self.history) > 1 and self.history[1][0] <= now - keep:
            self.history.popleft()
        self.idle_since = (self.idle_since if self.idle_since is not None else now) \
            if obs.depth == 0 else None

        if self.replicas < p.min_replicas:
            return self._to(p.min_replicas, f"below the minimum of {p.min_replicas}")
        if self.replicas > p.max_replicas:
            return self._to(p.max_replicas, f"above the maximum of {p.max_replicas}")
        if self.replicas == 0 and obs.depth > 0:
            return self._to(max(1, raw), f"{obs.depth} request(s) waiting with no worker "
                                         "(scale from zero)")
        up = self._window(now, p.up_delay_s, min)
        if up is not None and up > self.replicas:
            return self._to(up, f"demand {obs.depth} over {self.replicas} worker(s) at "
                                f"{p.target_inflight} each for {p.up_delay_s:g}s"
                            + (f"; oldest waited {obs.oldest_age_s:.1f}s"
                               if obs.oldest_age_s > p.max_queue_age_s else ""))
        down = self._window(now, p.down_delay_s, max)
        if down is not None and down < self.replicas:
            if down == 0:
                idle_for = now - (self.idle_since if self.idle_since is not None else now)
                if idle_for >= p.zero_delay_s:
                    return self._to(0, f"idle for {idle_for:.0f}s (scale to zero)")
                down = 1  # the last worker waits for the longer delay
            if down < self.replicas:
                return self._to(down, f"demand {obs.depth} needs {down} worker(s) for the "
                                      f"last {p.down_delay_s:g}s")
        return None

    def _window(self, now: float, span: float,
                pick: Callable[[list[int]], int]) -> int | None:
        """min/max of the recommendations that held during the last `span` seconds
        (those made in it and the one in force when it opened), or None until the
        scaler has watched that long."""
        if self.started_at is None or now - self.started_at < span:
            return None
        opened = now - span
        values = [r for at, r in self.history if at > opened]
        held = [r for at, r in self.history if at <= opened]
        if held:
            values.append(held[-1])
        return pick(values) if values else None

    def _to(self, replicas: int, reason: str) -> Decision:
        self.replicas = replicas
        return Decision(replicas, reason)
