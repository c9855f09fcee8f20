"""The batch scheduler: which entries of the backlog start running now, and which running
requests give way, for any worker (the model worker, inference/worker.py, and the
upstream worker, inference/upstream/worker.py).

`BatchScheduler.next(running)` (each loop iteration, with the backlog non-empty):
- answers the entries whose deadline passed in the queue (an `expired_in_queue` final
  in the outbox; they leave the backlog);
- asks the scheduler (inference/engine/scheduler.py `admit`, pure) what joins the `running`
  requests: priorities, tenant fairness rotating from the last admitted tenant, each
  tenant's share of the running slots while others wait, a request on its last
  delivery alone;
- takes what it chose out of the backlog, opens its batch span (health) and returns it;
  the caller starts it (and answers, through the outbox, any it cannot start).
`BatchScheduler.preempt(running)` (a worker that can pause a running request: the model
worker) asks the scheduler (`preempt`) which running requests give way to tenants
waiting below their share; the caller pauses them and hands them back with `requeue`.
`admitted` keeps the request ids of the recent admissions (tests and debugging).

The share is the spec's `tenant_running_share`, else the SLUICE_TENANT_RUNNING_SHARE
setting (`running_share`).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from typing import Protocol

from django.conf import settings

from inference import queue as q
from inference.engine.entries import Pending, expired_in_queue
from inference.engine.health import Health
from inference.engine.intake import Intake
from inference.engine.output import error_event
from inference.engine.scheduler import admit, expired, preempt, share_cap
from inference.engine.writer import Outbox
from inference.spec import DeploymentSpec


class Holding(Protocol):
    """A running request as a worker holds it (a model row, an upstream call)."""

    @property
    def pending(self) -> Pending: ...


def running_share(spec: DeploymentSpec) -> float:
    """The share of the running slots one tenant may hold while others wait: the
    spec's, else the SLUICE_TENANT_RUNNING_SHARE setting (a worker process always has
    Django's settings: inference/worker.py main names them)."""
    if spec.tenant_running_share is not None:
        return spec.tenant_running_share
    return float(settings.SLUICE_TENANT_RUNNING_SHARE)


class BatchScheduler:
    def __init__(self, intake: Intake, outbox: Outbox, health: Health, *,
                 max_batch_size: int, max_deliveries: int, share: float = 1.0,
                 reserve: int = 0) -> None:
        """`share`: of max_batch_size, a tenant's while others wait (1.0: no cap);
        `reserve`: slots kept for later tenants by a worker that cannot preempt."""
        self.intake, self.outbox, self.health = intake, outbox, health
        self.max_batch_size, self.max_deliveries = max_batch_size, max_deliveries
        self.cap = share_cap(max_batch_size, share)  # ValueError outside (0, 1]
        self.reserve = reserve
        self._last_tenant: str | None = None  # the scheduler's rounds rotate from it
        self._alone: str | None = None  # a request on its last chance, running alone
        self.admitted: deque[list[str]] = deque(maxlen=256)

    def next(self, running: Mapping[str, Holding]) -> list[Pending]:
        """The entries to start now beside `running` (the requests that run, by id),
        taken out of the backlog; [] when none may start."""
        backlog = self.intake.backlog
        for pending in expired(backlog, q.now_ms()):
            self.intake.take([pending])
            self.outbox.final(pending, error_event(expired_in_queue()))
        if self._alone is not None and self._alone not in running:
            self._alone = None  # it has ended: the batch may grow again
        chosen, alone = admit(backlog, running=len(running),
                              max_batch_size=self.max_batch_size,
                              max_deliveries=self.max_deliveries,
                              alone_running=self._alone is not None,
                              after_tenant=self._last_tenant,
                              held=Counter(r.pending.tenant for r in running.values()),
                              cap=self.cap, reserve=self.reserve)
        if not chosen:
            return []
        if alone:
            self._alone = chosen[0].req.rid
        self.intake.take(chosen)
        self._last_tenant = chosen[-1].tenant
        self.admitted.append([p.req.rid for p in chosen])
        self.health.open_batch(chosen)
        return chosen

    def preempt(self, running: Mapping[str, Holding]) -> list[str]:
        """The ids of the running requests (`running`: in start order) that give way
        now to tenants waiting below their share; [] while a request runs alone."""
        if self._alone is not None and self._alone in running:
            return []
        victims = preempt([r.pending for r in running.values()], self.intake.backlog,
                          max_batch_size=self.max_batch_size, cap=self.cap,
                          max_deliveries=self.max_deliveries)
        return [p.req.rid for p in victims]
