"""Admission: which entries of the backlog start running now, for any worker (the model
worker, inference/worker.py, and the upstream worker, inference/upstream/worker.py).

`Admission.next(running)` (each loop iteration, with the backlog non-empty):
- answers the entries whose deadline passed in the queue (an `expired_in_queue` final
  in the outbox; they leave the backlog);
- asks the scheduler (inference/scheduler.py `admit`, pure) what joins the `running`
  requests: priorities, tenant fairness rotating from the last admitted tenant, a
  request on its last delivery alone;
- takes what it chose out of the backlog, opens its batch span (health) and returns it;
  the caller starts it (and answers, through the outbox, any it cannot start).
`admitted` keeps the request ids of the recent admissions (tests and debugging).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

from inference import queue as q
from inference.engine.entries import Pending, expired_in_queue
from inference.engine.health import Health
from inference.engine.intake import Intake
from inference.engine.output import error_event
from inference.engine.writer import Outbox
from inference.scheduler import admit, expired


class Admission:
    def __init__(self, intake: Intake, outbox: Outbox, health: Health, *,
                 max_batch_size: int, max_deliveries: int) -> None:
        self.intake, self.outbox, self.health = intake, outbox, health
        self.max_batch_size, self.max_deliveries = max_batch_size, max_deliveries
        self._last_tenant: str | None = None  # the scheduler's rounds rotate from it
        self._alone: str | None = None  # a request on its last chance, running alone
        self.admitted: deque[list[str]] = deque(maxlen=256)

    def next(self, running: Collection[str]) -> list[Pending]:
        """The entries to start now beside `running` (the ids of the requests that
        run), taken out of the backlog; [] when none may start."""
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
                              after_tenant=self._last_tenant)
        if not chosen:
            return []
        if alone:
            self._alone = chosen[0].req.rid
        self.intake.take(chosen)
        self._last_tenant = chosen[-1].tenant
        self.admitted.append([p.req.rid for p in chosen])
        self.health.open_batch(chosen)
        return chosen
