"""Which waiting requests a worker admits next, and which running ones give way: priority
first, then round-robin across tenants (oldest request of each tenant in turn), so a
tenant's flood cannot starve another tenant's single request; a request on its last
allowed delivery runs alone; a request whose deadline passed is not admitted.

Fair share of running capacity: while another tenant waits, a tenant holds at most
`cap` running sequences (`share_cap`: a share of max_batch_size). Alone, a tenant may
use every slot (work-conserving); when another tenant then arrives below its share and
no slot is free, `preempt` names the running sequences that give way: the newest ones
of the tenants furthest over their share (vLLM's preemption picks its newest too).
Shares count sequences whatever their priority: priority orders a tenant's own work
and the admission of what fits, never one tenant's hold over another's share.

Pure functions: no Redis, no clock (the caller passes the time)."""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
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
R = TypeVar("R", bound=Waiting)


def share_cap(max_batch_size: int, share: float) -> int:
    """The running sequences a tenant may hold while others wait: `share` (0 < share
    <= 1) of max_batch_size, rounded down, at least one."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"a tenant's running share must be in (0, 1], got {share}")
    return max(1, math.floor(max_batch_size * share + 1e-9))


def pick(waiting: Sequence[W], capacity: int, *, after_tenant: str | None = None,
         limits: Mapping[str, int] | None = None) -> list[W]:
    """Up to `capacity` items of `waiting` (which is in arrival order).

    Higher priority classes are served entirely before lower ones; inside a class each
    tenant gets one slot per round, in order of its oldest request, starting after
    `after_tenant` (the last tenant served), so rounds rotate across calls too.
    `limits`: at most that many items of a tenant it names (across classes)."""
    chosen: list[W] = []
    left = dict(limits) if limits is not None else None
    for prio in sorted({w.priority for w in waiting}, reverse=True):
        queues: OrderedDict[str, list[W]] = OrderedDict()
        for item in waiting:
            if item.priority == prio:
                queues.setdefault(item.tenant, []).append(item)
        order = list(queues)
        if after_tenant is not None and after_tenant in queues:
            i = order.index(after_tenant) + 1
            order = order[i:] + order[:i]
        if left is not None:
            for tenant in order:
                if tenant in left:
                    del queues[tenant][max(0, left[tenant]):]
        while len(chosen) < capacity and any(queues[t] for t in order):
            for tenant in order:
                if queues[tenant] and len(chosen) < capacity:
                    chosen.append(queues[tenant].pop(0))
                    if left is not None and tenant in left:
                        left[tenant] -= 1
        if len(chosen) >= capacity:
            break
    return chosen


def expired(waiting: Sequence[D], now_ms: int) -> list[D]:
    """The items of `waiting` whose deadline is `now_ms` or earlier."""
    return [w for w in waiting if w.deadline_ms <= now_ms]


def admit(waiting: Sequence[D], *, running: int, max_batch_size: int, max_deliveries: int,
          alone_running: bool = False, after_tenant: str | None = None,
          held: Mapping[str, int] | None = None, cap: int | None = None,
          reserve: int = 0) -> tuple[list[D], bool]:
    """What joins a batch of `running` rows now, and whether it must run alone.

    A request delivered `max(2, max_deliveries)` times or more (its batches kept
    failing) may be what fails them, a poison pill, or the unlucky neighbour of one: on
    that last allowed delivery it runs alone, once the running batch has ended, and
    nothing joins it while it runs (`alone_running`). A neighbour then finishes, and a
    poison pill fails by itself without taking others with it.

    Otherwise `pick` fills the free slots in two passes: first each tenant up to its
    share (`cap` less what it `held`s running, by tenant), then, with what is left,
    anyone (work-conserving). A worker that cannot preempt keeps `reserve` slots of
    that second pass free unless one tenant is all there is (running and waiting), so a
    tenant arriving later finds a slot at once."""
    capacity = max_batch_size - running
    if alone_running or capacity <= 0 or not waiting:
        return [], False
    limit = max(2, max_deliveries)
    last = [w for w in waiting if w.deliveries >= limit]
    if last:
        return ([], False) if running else (last[:1], True)
    if cap is None:
        return pick(waiting, capacity, after_tenant=after_tenant), False
    held = held or {}
    waiting_tenants = {w.tenant for w in waiting}
    limits = {t: cap - held.get(t, 0) for t in waiting_tenants}
    chosen = pick(waiting, capacity, after_tenant=after_tenant, limits=limits)
    present = waiting_tenants | {t for t, n in held.items() if n > 0}
    left = capacity - len(chosen) - (reserve if len(present) > 1 else 0)
    if left > 0:
        taken = {id(w) for w in chosen}
        rest = [w for w in waiting if id(w) not in taken]
        chosen += pick(rest, left, after_tenant=after_tenant)
    return chosen, False


def preempt(running: Sequence[R], waiting: Sequence[Delivered], *, max_batch_size: int,
            cap: int, max_deliveries: int) -> list[R]:
    """The running items (in start order, oldest first) that give way now, newest
    first: as many as the waiting tenants below their share could start beyond the
    free slots, each taken from the tenant then furthest over `cap` (ties: the first
    such tenant in `running`), never taking a tenant below its share. None while a
    request on its last delivery waits (the batch is draining for it to run alone)."""
    if not waiting:
        return []
    if any(w.deliveries >= max(2, max_deliveries) for w in waiting):
        return []
    held = Counter(r.tenant for r in running)
    wanted = Counter(w.tenant for w in waiting)
    need = sum(min(n, cap - held[t]) for t, n in wanted.items() if held[t] < cap)
    short = need - max(0, max_batch_size - len(running))
    over = {t: n - cap for t, n in held.items() if n > cap}
    newest_first: dict[str, list[R]] = {t: [] for t in over}
    for item in reversed(running):
        if item.tenant in over:
            newest_first[item.tenant].append(item)
    victims: list[R] = []
    while short > 0 and over:
        tenant = max(over, key=lambda t: over[t])
        victims.append(newest_first[tenant].pop(0))
        over[tenant] -= 1
        if not over[tenant]:
            del over[tenant]
        short -= 1
    return victims
