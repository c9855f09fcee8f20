"""The autoscaler as it runs: `manage.py autoscale` as a real process with its workers as
real child processes, the live gateway in front, the test Redis and database behind."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from inference import autoscaler
from inference.autoscale import Observation, ScalePolicy, Scaler
from inference.models import Deployment
from inference.spec import DeploymentSpec, RuntimeName
from inference.supervisor import Pool, Proc
from inference.worker import heartbeats
from sluice.redis import sync_redis
from tenants.roles import Role
from tests.conftest import REPO, eventually, make_org, process_env
from tests.governance.test_metrics import scrape, value
from tests.streaming.conftest import Live

# Each test starts an autoscaler and its workers and stops them (drained) after: on a
# loaded 2-core machine that alone can take minutes, past the suite's default timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

SCALED: dict[str, Any] = {"runtime": "echo", "echo_token_delay_ms": 20, "max_batch_size": 8,
          "min_replicas": 0, "max_replicas": 3, "target_inflight": 2,
          "scale_up_delay_s": 0.5, "scale_down_delay_s": 1.0, "scale_to_zero_delay_s": 2.0,
          "max_queue_age_s": 5.0}


def live_pids(name: str = "scaled") -> set[int]:
    return {int(b["pid"]) for b in heartbeats(sync_redis(), name, max_age_s=2.0).values()}


def scale_events(name: str = "scaled", kind: str | None = None) -> list[dict[str, Any]]:
    rows = autoscaler.events(sync_redis(), deployment=name, limit=500)
    return [e for e in reversed(rows) if kind is None or e["kind"] == kind]


@pytest.fixture
def start_autoscaler(live: Live) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(hung_after: float | None = None, **policy: Any) -> subprocess.Popen[bytes]:
        Deployment.objects.create(name="scaled", **{**SCALED, **policy})
        extra = ["--hung-after", str(hung_after)] if hung_after is not None else []
        proc = subprocess.Popen([sys.executable, str(REPO / "manage.py"), "autoscale",
                                 "--deployment", "scaled", "--tick", "0.1", *extra], cwd=REPO,
                                env=process_env(SLUICE_LOG_LEVEL="WARNING"))
        procs.append(proc)
        # Its start-up (Django, the preloaded runtime) is not what the tests time: on a
        # busy machine it alone can take tens of seconds.
        eventually(lambda: _ticked(proc), 120, what="the autoscaler's first tick")
        return proc

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(30)
    # The workers drain and leave with their parent.
    eventually(lambda: not live_pids(), 15, what="the workers to stop")


def _ticked(proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, f"the autoscaler exited with code {proc.returncode}"
    row = autoscaler.state(sync_redis()).get("scaled")
    return row is not None and row["autoscaler"].startswith(f"{socket.gethostname()}-{proc.pid}-")


@pytest.fixture
def caller(live: Live) -> OpenAI:
    org = make_org("scaling", [Role.DEVELOPER])
    return OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER], max_retries=0,
                  timeout=30)


def chat(client: OpenAI, tokens: int = 5) -> str:
    reply = client.chat.completions.create(
        model="scaled", max_tokens=tokens,
        messages=[{"role": "user", "content": " ".join(["word"] * 50)}])
    return reply.choices[0].message.content or ""


class Load:
    """`threads` callers each sending one request after another until `stop()` or for
    `seconds`; `join()` waits for them and raises the first caller's error."""

    def __init__(self, client: OpenAI, threads: int, seconds: float, *, tokens: int,
                 pause: Callable[[], float] = lambda: 0.0) -> None:
        self.errors: list[BaseException] = []
        self.done = threading.Event()
        self.end = time.monotonic() + seconds
        self.sent = 0
        self.threads = [threading.Thread(target=self._caller, args=(client, tokens, pause))
                        for _ in range(threads)]
        for thread in self.threads:
            thread.start()

    def _caller(self, client: OpenAI, tokens: int, pause: Callable[[], float]) -> None:
        while not self.done.is_set() and time.monotonic() < self.end:
            try:
                chat(client, tokens)
            except BaseException as exc:  # raised again by join()
                self.errors.append(exc)
                return
            self.sent += 1
            self.done.wait(pause())

    def stop(self) -> None:
        self.done.set()

    def join(self) -> None:
        for thread in self.threads:
            thread.join()
        if self.errors:
            raise self.errors[0]


def load(client: OpenAI, threads: int, seconds: float, *, tokens: int,
         pause: Callable[[], float] = lambda: 0.0) -> Load:
    return Load(client, threads, seconds, tokens=tokens, pause=pause)


def test_a_request_at_zero_is_served_and_the_cold_start_is_recorded(
        start_autoscaler: Callable[..., Any], caller: OpenAI, live: Live) -> None:
    # One request, one worker: a cold start slower than max_queue_age_s (a loaded CI
    # machine) would rightly add a second one, and a second cold start to count.
    start_autoscaler(max_queue_age_s=60)
    time.sleep(1.5)
    assert not live_pids(), "min_replicas is 0: nothing runs before demand"
    began = time.monotonic()
    assert chat(caller).strip()
    cold_ttft = time.monotonic() - began
    assert cold_ttft < 10
    scaled = scale_events(kind="scale")
    assert scaled[0]["to"] == "1" and "scale from zero" in scaled[0]["reason"]
    ready = eventually(lambda: scale_events(kind="ready"), 5, what="the ready event")
    assert 0 < float(ready[0]["cold_start_s"]) < cold_ttft
    def published() -> dict[Any, float] | None:
        samples = scrape(live)
        wanted = value(samples, "sluice_autoscaler_desired_replicas", deployment="scaled")
        return samples if wanted == 1 else None

    samples = eventually(published, 5, what="the autoscaler's series on /metrics")
    assert samples is not None
    assert value(samples, "sluice_cold_start_seconds_count", deployment="scaled") == 1
    assert value(samples, "sluice_autoscaler_events_total", deployment="scaled",
                 kind="scale") >= 1


def test_a_burst_scales_out_and_idle_returns_to_zero(
        start_autoscaler: Callable[..., Any], caller: OpenAI) -> None:
    start_autoscaler()
    began = time.monotonic()
    # ~8 in flight: 4+ workers' worth, for longer than scaling out can take here
    runner = load(caller, threads=8, seconds=12, tokens=30)
    # Each scale step waits scale_up_delay_s; each new worker forks from the preloaded
    # parent. Generous bound: this box's two cores also run the load and the gateway.
    eventually(lambda: len(live_pids()) >= 3, 15, what="3 workers (the max)")
    reached = time.monotonic() - began
    assert reached < 15
    assert len(live_pids()) <= 3, "never past max_replicas"
    runner.join()
    stopped = time.monotonic()
    eventually(lambda: not live_pids(), 15, what="scale to zero")
    # Down to one after the down delay, to zero only after the zero delay.
    tail = [e for e in scale_events(kind="scale") if float(e["ts"]) > time.time() - 20]
    assert [e["to"] for e in tail][-1] == "0" and "scale to zero" in tail[-1]["reason"]
    assert "1" in [e["to"] for e in tail]
    assert time.monotonic() - stopped >= SCALED["scale_to_zero_delay_s"]


def test_a_killed_worker_is_replaced(start_autoscaler: Callable[..., Any],
                                     caller: OpenAI) -> None:
    start_autoscaler(min_replicas=1)
    first = eventually(live_pids, 15, what="the minimum worker")
    victim = next(iter(first))
    os.kill(victim, signal.SIGKILL)
    replacement = eventually(lambda: live_pids() - {victim}, 15, what="a replacement")
    assert victim not in replacement
    restart = scale_events(kind="restart")
    assert restart and f"worker pid {victim} exited" in restart[-1]["reason"]
    assert chat(caller).strip()


def test_steady_load_near_the_threshold_does_not_flap(
        start_autoscaler: Callable[..., Any], caller: OpenAI) -> None:
    """About 2-3 requests in flight against a target of 2 per worker: right at the line
    between one worker and two. After the scale from zero, at most one more change
    while the load holds, for twice the down window (a busy machine slows every part:
    the windows are wall-clock, so the load's stretch is too)."""
    import random

    start_autoscaler(scale_up_delay_s=1.0, scale_down_delay_s=5.0)
    runner = load(caller, threads=3, seconds=300, tokens=10,
                  pause=lambda: random.uniform(0, 0.1))
    try:
        eventually(lambda: scale_events(kind="ready"), 60, what="the first worker ready")
        steady_from = time.monotonic()
        eventually(lambda: time.monotonic() - steady_from >= 12 or runner.errors, 60)
        ended = time.time()
    finally:
        runner.stop()
        runner.join()
    scaled = [e for e in scale_events(kind="scale") if float(e["ts"]) <= ended]
    assert "scale from zero" in scaled[0]["reason"], scaled
    assert len(scaled[1:]) <= 1, [(e["from"], e["to"], e["reason"]) for e in scaled]


def test_a_queue_aging_through_a_cold_start_adds_no_worker() -> None:
    """The oldest request waited long because nothing served it: workers were starting.
    That says nothing about whether they keep up, so it adds none; once they are all
    ready and it still ages, one more."""
    policy = ScalePolicy(min_replicas=0, max_replicas=4, target_inflight=2,
                         up_delay_s=1.0, down_delay_s=5.0, max_queue_age_s=5.0)
    scaler = Scaler(policy)
    decision = scaler.decide(Observation(3, 20.0), 0.0)
    assert decision is not None and decision.replicas == 2
    for i in range(1, 30):  # 6 s of the two starting while the queue ages
        assert scaler.decide(Observation(3, 20.0 + i * 0.2, starting=2), i * 0.2) is None
    later = [scaler.decide(Observation(3, 27.0 + i * 0.2), 6.0 + i * 0.2) for i in range(8)]
    assert [d.replicas for d in later if d] == [3]


def test_a_starved_loop_decides_on_the_whole_window() -> None:
    """A loop that observes once after a pause longer than the up window (a loaded
    machine) does not scale on that one reading: the reading before the pause held
    for the rest of the window."""
    policy = ScalePolicy(min_replicas=1, max_replicas=4, target_inflight=2,
                         up_delay_s=1.0, down_delay_s=5.0)
    scaler = Scaler(policy, replicas=1)
    for i in range(30):
        assert scaler.decide(Observation(2, 0.0), i * 0.2) is None
    assert scaler.decide(Observation(3, 0.0), 7.5) is None  # one reading after 1.7 s
    assert scaler.decide(Observation(3, 0.0), 8.2) is None  # 0.7 s of it so far
    decision = scaler.decide(Observation(3, 0.0), 8.6)  # 1.1 s of it
    assert decision is not None and decision.replicas == 2


def test_a_hung_worker_is_killed_and_replaced(start_autoscaler: Callable[..., Any],
                                              caller: OpenAI) -> None:
    """A worker that stops (SIGSTOP: alive, holding its place, serving nothing, as a
    wedged device would leave it) is killed once it has been silent for --hung-after
    and replaced; calls are served again."""
    start_autoscaler(min_replicas=1, hung_after=2)
    first = eventually(live_pids, 15, what="the minimum worker")
    victim = next(iter(first))
    os.kill(victim, signal.SIGSTOP)
    try:
        replacement = eventually(lambda: live_pids() - {victim}, 20, what="a replacement")
        assert victim not in replacement
        restart = scale_events(kind="restart")
        assert restart and f"worker pid {victim} sent no heartbeat" in restart[-1]["reason"]
        eventually(lambda: not _alive(victim), 5, what="the hung worker to be gone")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
    assert chat(caller).strip()


def _alive(pid: int) -> bool:
    """Running or stopped; a zombie (dead, not yet reaped by its parent) is not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(") ", 1)[-1][0] != "Z"


def test_silence_counts_only_while_the_autoscaler_watches(rds: Any) -> None:
    """After a gap in watching (Redis down: the workers could not beat either; another
    autoscaler leading), a worker is not killed for the gap: its silence counts from
    the autoscaler's return. Silent for hung_after_s while watched, it is killed."""
    spec = DeploymentSpec(f"watched-{os.getpid()}", RuntimeName.ECHO)
    scaler = autoscaler.Autoscaler(sync_redis(), "redis://unused", hung_after_s=0.3,
                                   tick_s=0.1)
    target = autoscaler.Target(spec, Scaler(ScalePolicy()))
    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    process.start()
    proc = Proc(process, time.monotonic())
    scaler.supervisor.pools[spec.name] = Pool(spec, procs=[proc])
    try:
        target.ready.add(proc.pid)
        scaler._kill_hung(target, {proc.pid: 0})  # seen beating
        # Then nobody looked for a minute (no tick: the clocks as a minute later).
        target.watched -= 60
        target.beat[proc.pid] -= 60
        scaler._kill_hung(target, {})  # silent: but for how long was it watched?
        assert not proc.stopping and process.is_alive()
        time.sleep(0.4)
        scaler._kill_hung(target, {})  # silent for 0.4 s of watching
        assert proc.stopping
        process.join(5)
        assert process.exitcode == -signal.SIGKILL
    finally:
        if process.is_alive():
            process.kill()
        process.join()
