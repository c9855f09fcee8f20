"""What a call costs: a model's price at a moment, and a call's cost in exact integers.

Prices are stored as decimals (governance.models.Price, US dollars per million tokens,
six places). Costs are integers of nano-dollars (1e-9 USD): a price in micro-dollars
per million tokens times a token count is pico-dollars, exactly; a call's cost is that
sum rounded up to the next nano-dollar, once per call. Sums of calls are therefore
exact (no float is ever added), and what a call is charged never depends on how many
other calls it was added to. In Redis (budgets) a nano-dollar count stays exact up to
2**53, about 9 million dollars per counter.

A model's price at a time is the version with the latest `valid_from` at or before it;
before its first version a model has no price (its calls cost nothing and say so: no
`x-sluice-cost-usd`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from governance.models import Price

NANO_PER_USD = 10**9
COST_HEADER = "x-sluice-cost-usd"  # a priced reply's cost, `usd()` of its nano-dollars
_MICRO = Decimal(10**6)
_PLACES = Decimal("0.000001")


@dataclass(frozen=True, slots=True)
class Terms:
    """One price version in integers: micro-dollars per million tokens (input, output,
    cached input) and nano-dollars per GPU-second (None: not priced by device time)."""

    valid_from: datetime
    input: int
    output: int
    cached_input: int
    gpu_second: int | None = None

    @classmethod
    def of(cls, row: Price) -> Terms:
        cached = row.cached_input_per_mtok_usd
        return cls(valid_from=row.valid_from, input=micros(row.input_per_mtok_usd),
                   output=micros(row.output_per_mtok_usd),
                   cached_input=micros(row.input_per_mtok_usd if cached is None else cached),
                   gpu_second=(None if row.gpu_second_usd is None
                               else int(Decimal(row.gpu_second_usd) * NANO_PER_USD)))

    def worst(self, tokens: int, seconds: float = 0.0) -> int:
        """Nano-dollars that `tokens` (a call's bound: its prompt's and what it may
        generate) cost at most, each at the highest of the prices, plus, with a price
        per GPU-second, `seconds` of the whole device (a call's share of the steps it
        ran in never exceeds the time it ran, at most its deadline): what a budget
        reserves, never less than the call's real `cost`."""
        most = -(-tokens * max(self.input, self.output, self.cached_input) // 1000)
        if self.gpu_second:
            most += math.ceil(seconds * self.gpu_second)
        return most

    def cost(self, prompt: int, completion: int, cached: int = 0, device_us: int = 0) -> int:
        """Nano-dollars for a call's tokens; `cached` of the `prompt` tokens at the
        cached-input price; with a price per GPU-second, `device_us` microseconds of the
        device (its share of the steps: inference/engine/engine.py). Rounded up once, so
        a priced call never costs 0 unless its prices are 0."""
        if not 0 <= cached <= prompt or completion < 0 or device_us < 0:
            raise ValueError(f"usage out of range: {prompt=} {completion=} {cached=} "
                             f"{device_us=}")
        pico = ((prompt - cached) * self.input + cached * self.cached_input
                + completion * self.output)
        # femto-dollars: pico * 1000, and µs x nano-dollars per second
        femto = pico * 1000 + device_us * (self.gpu_second or 0)
        return -(-femto // 10**6)


def micros(usd: Decimal | int | str) -> int:
    """A price per million tokens (US dollars, at most six places) in micro-dollars."""
    return int(Decimal(usd) * _MICRO)


def usd(nanos: int) -> str:
    """Nano-dollars as a fixed-point dollar string: 1050 -> "0.000001050"."""
    sign = "-" if nanos < 0 else ""
    whole, frac = divmod(abs(nanos), NANO_PER_USD)
    return f"{sign}{whole}.{frac:09d}"


class Versions:
    """A model's price versions, oldest first; `at(t)` the one valid at t."""

    def __init__(self, terms: Iterable[Terms]) -> None:
        self._terms = sorted(terms, key=lambda t: t.valid_from)
        self._starts = [t.valid_from for t in self._terms]

    def at(self, when: datetime) -> Terms | None:
        i = bisect.bisect_right(self._starts, when)
        return self._terms[i - 1] if i else None

    def __bool__(self) -> bool:
        return bool(self._terms)


def versions(model: str) -> Versions:
    """Every stored price version of `model` (a database read: callers cache it)."""
    return Versions(Terms.of(row) for row in Price.objects.filter(model=model))


def cost_at(model: str, when: datetime, prompt: int, completion: int,
            cached: int = 0) -> int | None:
    """Nano-dollars for a call of `model` admitted at `when`; None: no price then."""
    terms = versions(model).at(when)
    return None if terms is None else terms.cost(prompt, completion, cached)


# -- LiteLLM's model_prices_and_context_window.json ----------------------------------
@dataclass(frozen=True)
class Imported:
    """One entry of a LiteLLM price file as a price's fields (US dollars per million
    tokens), or why it was left out."""

    name: str
    fields: dict[str, Decimal] | None
    skipped: str = ""


def per_mtok(per_token: Any) -> Decimal | None:
    """LiteLLM's dollars per token as dollars per million tokens, exact to six places
    (read from the file's text as a Decimal, never through a float); None when absent
    or not a non-negative number."""
    if isinstance(per_token, bool) or not isinstance(per_token, int | Decimal):
        return None
    value = Decimal(per_token) * _MICRO
    if not value.is_finite() or value < 0:
        return None
    return value.quantize(_PLACES, rounding=ROUND_HALF_EVEN)


def from_litellm(data: dict[str, Any], names: Sequence[str] = ()) -> list[Imported]:
    """The entries of a LiteLLM price file (parsed with `parse_float=Decimal`) that
    price tokens: every one, or those in `names`. An entry without an input and an
    output price per token (images, audio, the file's `sample_spec`) is skipped with a
    reason; an unknown name in `names` too."""
    out: list[Imported] = []
    for name in names or [k for k in data if k != "sample_spec"]:
        entry = data.get(name)
        if not isinstance(entry, dict):
            out.append(Imported(name, None, "not in the file"))
            continue
        prices = {"input_per_mtok_usd": per_mtok(entry.get("input_cost_per_token")),
                  "output_per_mtok_usd": per_mtok(entry.get("output_cost_per_token"))}
        if None in prices.values():
            out.append(Imported(name, None, "no input and output price per token"))
            continue
        cached = per_mtok(entry.get("cache_read_input_token_cost"))
        fields = {k: v for k, v in prices.items() if v is not None}
        if cached is not None:
            fields["cached_input_per_mtok_usd"] = cached
        out.append(Imported(name, fields))
    return out
