"""Decode throughput with every row grammar-constrained (llguidance) against the same rows
unconstrained, measured in the same run, and what the masks cost per step.

For each model and batch size B, B rows with distinct prompts decode greedily through
`CausalLMRuntime.add/step/drop`. Constrained, every row has a Constraint built as the
worker builds it (`inference.structured.constraint.plan_for` of the request body): even rows a
structured answer of the pydantic `Order` schema (tests/inference/grammar_corpus.py's
"pydantic_order": an array of $ref objects, a bounded string, a number, anyOf with null),
odd rows a required call of one of two tools (`tool_choice: "required"`, no parallel
calls). Unconstrained: the same prompts and sampling, no constraint.

Constrained rows finish early (a reply here completes in 30-100 tokens). Choice: finished
rows are restarted, as continuous batching would: after each step every row whose
constraint is done, or that reached --max-tokens, is dropped and added again (same
prompt, a fresh constraint), outside the timed region. The unconstrained side replays
the same restart schedule (recorded from the constrained side; greedy decoding makes
it the same every round), so both sides time exactly --steps decode steps of B rows
each (B x steps tokens) over caches of the same shapes, and every timed constrained step
has all B rows masking, over whole replies (their start, middle and closing). Prefills
are not timed on either side. Rounds alternate which side goes first; figures are the
median of --rounds rounds after one warm-up round.

Per constrained step it also reports: the mask computation (`masks._compute`:
llguidance filling the batch's bitmask on its threads; of it, "closing": narrowing the
rows whose budget is nearly spent), how long `step()` waited for it after the forward
pass (`future.result()`: "hidden" is the rest), `Masks.apply` (the bitmask applied to
the logits) and advancing the matchers with the sampled tokens (`Constraint.advance`);
once per model, a request's grammar compile (`plan`, uncached: the worker caches plans
per tools/format) and matcher creation (`Constraint`, every request). "restarts": the
rows restarted in the last constrained round.

torch runs --threads threads (default 1, as SLUICE_TORCH_THREADS gives CPU workers
sharing a machine; on this 2-core VM that leaves llguidance a core). The goal of issue
#29: constrained >= 90% of unconstrained tokens/s at batch 32 on the CPU.

    .venv/bin/python tests/bench/bench_grammar.py [--device auto|cpu|cuda]
        [--models tiny,smollm2] [--batch-sizes 1,8,32] [--steps 64] [--rounds 5]
        [--max-tokens 128] [--threads 1] [--verbose]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "platform")]

from inference.runtimes import load_runtime  # noqa: E402
from inference.runtimes.base import NewSequence, SamplingParams  # noqa: E402
from inference.runtimes.causal_lm import CausalLMRuntime  # noqa: E402
from inference.spec import DeploymentSpec, RuntimeName  # noqa: E402
from inference.structured import masks  # noqa: E402
from inference.structured.constraint import Constraint, Vocabulary, plan_for  # noqa: E402
from inference.structured.grammar import Plan, Tool, plan  # noqa: E402
from inference.weights import SMOLLM2, pick_device  # noqa: E402
from tests.inference.grammar_corpus import SCHEMAS  # noqa: E402

TOOLS: list[dict[str, Any]] = [
    {"name": "get_weather", "strict": False, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "unit", "days"],
        "properties": {"city": {"type": "string", "maxLength": 40},
                       "unit": {"enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14}}}},
    {"name": "search_orders", "strict": False, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["customer"],
        "properties": {"customer": {"type": "string", "maxLength": 40},
                       "status": {"anyOf": [{"enum": ["open", "shipped", "returned"]},
                                            {"type": "null"}]},
                       "limit": {"type": "integer", "minimum": 1, "maximum": 50}}}},
]
ORDER = {"response_format": {"schema": SCHEMAS["pydantic_order"], "strict": False}}
CALL = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
SYSTEM = ('You can call functions. To call one, reply with <tool_call> followed by a JSON '
          'object {"name": <function name>, "arguments": <arguments>}. Functions: '
          + str([{"name": t["name"], "parameters": t["parameters"]} for t in TOOLS]))
CITIES = ["Paris", "Lagos", "Lima", "Oslo", "Osaka", "Quito", "Perth", "Cork"]


def body(row: int) -> dict[str, Any]:
    return ORDER if row % 2 == 0 else CALL


def plan_of(row: int) -> Plan:
    chosen = plan_for(body(row))
    assert chosen is not None
    return chosen


def messages(row: int) -> list[dict[str, str]]:
    city = CITIES[row % len(CITIES)]
    if row % 2 == 0:
        return [{"role": "user", "content": f"Order {row + 1} cups of tea and a scone for "
                                            f"the shop in {city}, as JSON."}]
    asks = [f"What will the weather be in {city} for the next {row % 7 + 2} days?",
            f"Find the open orders of customer number {row} from {city}."]
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": asks[(row // 2) % 2]}]


class Clock:
    """Accumulated seconds and counts of the instrumented calls, while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def add(self, name: str, seconds: float) -> None:
        if self.on:
            self.seconds[name] += seconds
            self.calls[name] += 1

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - started)
        return wrapper


class _TimedFuture:
    def __init__(self, future: Any, clock: Clock) -> None:
        self.future, self.clock = future, clock

    def result(self) -> Any:
        started = time.perf_counter()
        try:
            return self.future.result()
        finally:
            self.clock.add("wait", time.perf_counter() - started)


@contextmanager
def instrumented(clock: Clock) -> Iterator[None]:
    """Time masks._compute (on the mask thread), the caller's wait on its future,
    Masks.apply and Constraint.advance. Restores them after."""
    saved = (masks._compute, masks._close, masks.start, masks.Masks.apply,
             Constraint.advance)
    start = masks.start

    def timed_start(constraints: Any) -> Any:
        pending = start(constraints)
        return _TimedFuture(pending, clock) if pending is not None else None

    setattr(masks, "_compute", clock.timed("compute", masks._compute))  # noqa: B010
    setattr(masks, "_close", clock.timed("close", masks._close))  # noqa: B010
    setattr(masks, "start", timed_start)  # noqa: B010
    setattr(masks.Masks, "apply", clock.timed("apply", masks.Masks.apply))  # noqa: B010
    setattr(Constraint, "advance", clock.timed("advance", Constraint.advance))  # noqa: B010
    try:
        yield
    finally:
        for owner, name, fn in zip((masks, masks, masks, masks.Masks, Constraint),
                                   ("_compute", "_close", "start", "apply", "advance"),
                                   saved, strict=True):
            setattr(owner, name, fn)


class Bench:
    def __init__(self, rt: CausalLMRuntime, vocab: Vocabulary, max_tokens: int) -> None:
        self.rt, self.vocab, self.max_tokens = rt, vocab, max_tokens
        self.prompts = [rt.encode_chat(messages(row)) for row in range(64)]
        self.params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def seq(self, row: int, generation: int, constrained: bool) -> NewSequence:
        constraint = Constraint(self.vocab, plan_of(row), budget=self.max_tokens) \
            if constrained else None
        return NewSequence(f"{row}.{generation}", self.prompts[row], self.params,
                           constraint=constraint)

    def run(self, batch: int, steps: int, constrained: bool,
            schedule: list[list[int]] | None, clock: Clock) -> tuple[float, list[list[int]]]:
        """Decode `steps` timed steps of `batch` rows; restarts per `schedule` (the rows
        to restart after each step) or, when None, as rows finish (recorded)."""
        generation = [0] * batch
        live = {row: self.seq(row, 0, constrained) for row in range(batch)}
        self.rt.add(list(live.values()))
        produced = dict.fromkeys(range(batch), 1)  # add() sampled each row's first token
        recorded: list[list[int]] = []
        elapsed = 0.0
        for step in range(steps):
            clock.on = constrained
            started = time.perf_counter()
            self.rt.step()
            elapsed += time.perf_counter() - started
            clock.on = False
            for row in produced:
                produced[row] += 1
            if schedule is not None:
                restart = schedule[step]
            else:
                restart = [row for row, s in live.items()
                           if s.constraint.done or produced[row] >= self.max_tokens]
            recorded.append(restart)
            if restart and step < steps - 1:
                self.rt.drop([live[row].rid for row in restart])
                for row in restart:
                    generation[row] += 1
                    live[row] = self.seq(row, generation[row], constrained)
                    produced[row] = 1
                self.rt.add([live[row] for row in restart])
        self.rt.drop([s.rid for s in live.values()])
        return batch * steps / elapsed, recorded


def compile_costs(vocab: Vocabulary, repeat: int = 20) -> tuple[float, float, float]:
    """Median ms of: compiling the Order format's grammar, the two-tool call's grammar
    (uncached `plan`), and creating a matcher (`Constraint`) for each in turn."""
    order_ms, call_ms, matcher_ms = [], [], []
    tools = [Tool(t["name"], t["parameters"]) for t in TOOLS]
    for _ in range(repeat):
        started = time.perf_counter()
        plan(response_format=ORDER["response_format"])
        order_ms.append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        plan(tools=tools, choice="required", parallel=False)
        call_ms.append((time.perf_counter() - started) * 1e3)
    for i in range(repeat):
        chosen = plan_of(i)
        started = time.perf_counter()
        Constraint(vocab, chosen, budget=128)
        matcher_ms.append((time.perf_counter() - started) * 1e3)
    return (statistics.median(order_ms), statistics.median(call_ms),
            statistics.median(matcher_ms))


def load(model: str, device: str) -> CausalLMRuntime:
    spec = DeploymentSpec("tiny", RuntimeName.TINY_CAUSAL_LM, device=device) \
        if model == "tiny" else \
        DeploymentSpec("smol", RuntimeName.CAUSAL_LM, weights=SMOLLM2, device=device)
    rt = load_runtime(spec)
    assert isinstance(rt, CausalLMRuntime)
    return rt


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--verbose", action="store_true", help="print every round's tok/s")
    args = parser.parse_args()
    device = pick_device(args.device)
    torch.set_num_threads(args.threads)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    print(f"device {device} ({name}, torch {torch.__version__}), {args.threads} torch "
          f"thread(s), {args.steps} timed steps a side a round, median of {args.rounds} "
          f"rounds, max_tokens {args.max_tokens}, greedy; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    goal: list[str] = []
    for model in args.models.split(","):
        rt = load(model, device)
        started = time.perf_counter()
        vocab = Vocabulary(rt.tokenizer, int(rt.model.config.vocab_size),
                           sorted(rt.eos_token_ids))
        vocab_ms = (time.perf_counter() - started) * 1e3
        order_ms, call_ms, matcher_ms = compile_costs(vocab)
        print(f"\n{model}: vocabulary {vocab.size:,} (built once per worker: "
              f"{vocab_ms:.0f} ms); per request: grammar compile {order_ms:.2f} ms "
              f"(Order format) / {call_ms:.2f} ms (2-tool call), cached per tools/format; "
              f"matcher creation {matcher_ms:.2f} ms")
        print(f"{'batch':>5} {'unconstr tok/s':>14} {'constr tok/s':>12} {'ratio':>6} "
              f"{'restarts':>8} | per step ms: {'compute':>7} {'waited':>6} "
              f"{'hidden':>6} {'apply':>6} {'advance':>7} {'closing':>7}", flush=True)
        bench = Bench(rt, vocab, args.max_tokens)
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            clock = Clock()
            with instrumented(clock):
                _, schedule = bench.run(batch, args.steps, True, None, Clock())  # warm-up
                bench.run(batch, args.steps, False, schedule, clock)
                free: list[float] = []
                held: list[float] = []
                for r in range(args.rounds):
                    order = (True, False) if r % 2 == 0 else (False, True)
                    for constrained in order:
                        rate, got = bench.run(batch, args.steps, constrained,
                                              None if constrained else schedule, clock)
                        sync(device)
                        (held if constrained else free).append(rate)
                        if constrained:
                            schedule = got
            steps = args.rounds * args.steps
            per = {k: clock.seconds[k] / steps * 1e3 for k in
                   ("compute", "close", "wait", "apply", "advance")}
            hidden = 1 - per["wait"] / per["compute"] if per["compute"] else 0.0
            restarts = sum(len(rows) for rows in schedule)
            u, c = statistics.median(free), statistics.median(held)
            print(f"{batch:>5} {u:>14.1f} {c:>12.1f} {c / u:>6.1%} {restarts:>8} | "
                  f"{'':>12} {per['compute']:>7.3f} {per['wait']:>6.3f} {hidden:>6.0%} "
                  f"{per['apply']:>6.3f} {per['advance']:>7.3f} {per['close']:>7.3f}", flush=True)
            if args.verbose:
                print(f"      rounds, unconstrained: {', '.join(f'{x:.1f}' for x in free)}; "
                      f"constrained: {', '.join(f'{x:.1f}' for x in held)}")
            if batch == 32:
                goal.append(f"{model}: constrained/unconstrained at batch 32 = {c / u:.1%} "
                            f">= 90%: {'yes' if c / u >= 0.9 else 'no'}")
        del rt
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    for line in goal:
        print(f"goal ({device}) {line}")


if __name__ == "__main__":
    main()
