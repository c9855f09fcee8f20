"""Which waiting requests a worker admits next: priority first, then round-robin across
tenants (oldest request of each tenant in turn), so a tenant's flood cannot starve
another tenant's single request; a request on its last allowed delivery runs alone; a
request whose deadline passed is not admitted. Pure functions: no Redis, no clock (the
caller passes the time)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar


class Waiting(Protocol):
    @property
    def tenant(self) -> str: ...

    @property
    def priority(self) -> int: ...


class Delivered(Waiting, Protocol):
    @property
    def deliveries(self) -> int: ...

    @property
    def deadline_ms(self) -> int: ...


W = TypeVar("W", bound=Waiting)
D = TypeVar("D", bound=Delivered)


def pick(waiting: Sequence[W], capacity: int, *, after_tenant: str | None = None) -> list[W]:
    """Up to `capacity` items of `waiting` (which is in arrival order).

    Higher priority classes are served entirely before lower ones; inside a class each
    tenant gets one slot per round, in order of its oldest request, starting after
    `after_tenant` (the last tenant served), so rounds rotate across calls too."""
    chosen: list[W] = []
    for prio in sorted({w.priority for w in waiting}, reverse=True):
        queues: OrderedDict[str, list[W]] = OrderedDict()
        for item in waiting:
            if item.priority == prio:
                queues.setdefault(item.tenant, []).append(item)
        order = list(queues)
        if after_tenant is not None and after_tenant in queues:
            i = order.index(after_tenant) + 1
            order = order[i:] + order[:i]
        while len(chosen) < capacity and any(queues[t] for t in order):
            for tenant in order:
                if queues[tenant] and len(chosen) < capacity:
                    chosen.append(queues[tenant].pop(0))
        if len(chosen) >= capacity:
            break
    return chosen


def expired(waiting: Sequence[D], now_ms: int) -> list[D]:
    """The items of `waiting` whose deadline is `now_ms` or earlier."""
    return [w for w in waiting if w.deadline_ms <= now_ms]


def admit(waiting: Sequence[D], *, running: int, max_batch_size: int, max_deliveries: int,
          alone_running: bool = False, after_tenant: str | None = None
          ) -> tuple[list[D], bool]:
    """What joins a batch of `running` rows now, and whether it must run alone.

    A request delivered `max(2, max_deliveries)` times or more (its batches kept
    failing) may be what fails them, a poison pill, or the unlucky neighbour of one: on
    that last allowed delivery it runs alone, once the running batch has ended, and
    nothing joins it while it runs (`alone_running`). A neighbour then finishes, and a
    poison pill fails by itself without taking others with it. Otherwise `pick` fills
    the free slots."""
    capacity = max_batch_size - running
    if alone_running or capacity <= 0 or not waiting:
        return [], False
    limit = max(2, max_deliveries)
    last = [w for w in waiting if w.deliveries >= limit]
    if last:
        return ([], False) if running else (last[:1], True)
    return pick(waiting, capacity, after_tenant=after_tenant), False
