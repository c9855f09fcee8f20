"""The device-memory guard: a worker above the high-water mark of used memory leaves the
rotation (it stops pulling new requests; running ones finish) until its memory has stayed
below the low-water mark for `hold_s` seconds. When every worker of a deployment is out,
the gateways degrade (cap max_tokens, or refuse with 503, per the breaker policy) and the
workers keep serving at a quarter of their batch size.

The thresholds are per deployment, in `sluice:q:{<dep>}:guard` (governance writes them);
a worker reads them with every heartbeat, so an edit applies within about a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_HIGH = 0.92
DEFAULT_LOW = 0.85
DEFAULT_HOLD_S = 10.0


@dataclass
class MemoryGuard:
    high: float = DEFAULT_HIGH
    low: float = DEFAULT_LOW
    hold_s: float = DEFAULT_HOLD_S
    in_rotation: bool = True
    _below_since: float | None = field(default=None, repr=False)

    def configure(self, *, high: float, low: float, hold_s: float) -> None:
        if not 0 < low < high <= 1 or hold_s < 0:
            return  # governance validates; never act on a garbled value
        self.high, self.low, self.hold_s = high, low, hold_s

    def observe(self, used: int, total: int, now: float) -> bool:
        """Feed one reading (bytes used of total, monotonic time); True = in rotation."""
        fraction = used / total if total > 0 else 0.0
        if fraction >= self.high:
            self.in_rotation = False
            self._below_since = None
        elif not self.in_rotation:
            if fraction >= self.low:
                self._below_since = None
            elif self._below_since is None:
                self._below_since = now
            elif now - self._below_since >= self.hold_s:
                self.in_rotation = True
                self._below_since = None
        return self.in_rotation
