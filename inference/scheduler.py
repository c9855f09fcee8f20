"""Which waiting requests a worker admits next: priority first, then round-robin across
tenants (oldest request of each tenant in turn), so a tenant's flood cannot starve
another tenant's single request. Pure functions: no Redis, no clock."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar


class Waiting(Protocol):
    @property
    def tenant(self) -> str: ...

    @property
    def priority(self) -> int: ...


W = TypeVar("W", bound=Waiting)


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
