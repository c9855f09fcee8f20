"""Grammar verdicts for the gateway, bounded: a caller's schema never runs on the event
loop, never longer than a budget, never with more memory than a limit.

    precheck(request)                              # at once: GrammarError / TooComplex
    checker = GrammarChecker(processes=2, budget_s=2.0, memory_mb=512)
    await checker.check(request, tenant="acme")   # None, or GrammarError / TooComplex
    await checker.close()

llguidance's emptiness check of intersected regexes (an `allOf` of string `pattern`s)
grows about 2.5x in time and memory per pattern (16 patterns: 1 s and 140 MB; 18: 7 s
and 530 MB; at 26 a Rust allocation abort, at 200 a PanicException, a BaseException),
and its fuel limits do not bound it. So:
- `precheck` (in-process, one linear walk) refuses the obvious bombs at once: more
  schema bytes across a request than MAX_TOTAL_SCHEMA_BYTES, more custom tools' grammar
  (Lark, regex) bytes than MAX_TOTAL_DEFINITION_BYTES, more intersected patterns
  than MAX_INTERSECTED_PATTERNS, more pattern text than MAX_PATTERN_CHARS;
- the rest is compiled (inference/structured/grammar.py `plan`, exactly what the worker compiles)
  in a child process (`python -m inference.structured.grammar_check`) whose address space is capped
  at its size after imports plus `memory_mb`; a child that passes `budget_s`, runs out of
  memory or dies is killed and replaced, and the verdict is `TooComplex`;
- verdicts (both kinds) are cached by the request's hash, so a schema sent again costs a
  dictionary lookup, and a bomb sent again costs nothing;
- a tenant has at most one check running per checker: its flood waits behind itself,
  not in front of another tenant's schemas.

Wire (one JSON line each way, defined here only): the parent writes a PlanRequest, the
child answers a Verdict. The checker belongs to one event loop (its pipes do).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import resource
import sys
import time
import weakref
from collections import OrderedDict
from typing import Any

import msgspec

from inference.jobs import ChatJob
from inference.structured.grammar import MAX_SCHEMA_BYTES, GrammarError, Tool, plan, plan_args

MAX_TOTAL_SCHEMA_BYTES = 256 * 1024  # every tool's parameters and the response format
MAX_INTERSECTED_PATTERNS = 8  # `pattern`s one `allOf` intersects (8: ~5 ms to check)
MAX_PATTERN_CHARS = 16 * 1024  # all regex text of a request
MAX_TOTAL_DEFINITION_BYTES = 16 * 1024  # all custom tools' grammars of a request
_CACHE_ENTRIES = 4096
_CPU_BACKSTOP_S = 60
_START_S = 60.0  # a child's imports, on a machine that may be busy


class TooComplex(GrammarError):
    """A schema the engine could enforce only at an unbounded cost: refused as 400
    `schema_too_complex`; the message names where."""


class GrammarUnavailable(RuntimeError):
    """No checking process could be started (a retriable 503 for the caller)."""


class PlanRequest(msgspec.Struct, frozen=True):
    """What one check compiles: `grammar.plan`'s arguments."""

    tools: list[Tool] = []
    choice: str = "auto"
    parallel: bool = True
    response_format: dict[str, Any] | None = None

    @classmethod
    def of(cls, job: ChatJob) -> PlanRequest:
        return cls(**plan_args(job))

    def compile(self) -> None:
        """Compile as the worker will (grammar.plan); GrammarError names what fails."""
        plan(tools=self.tools, choice=self.choice,
             parallel=self.parallel, response_format=self.response_format)


class Verdict(msgspec.Struct, frozen=True):
    error: str | None = None  # GrammarError's message; None: it compiles


_encode = msgspec.json.Encoder().encode
_requests = msgspec.json.Decoder(PlanRequest)
_verdicts = msgspec.json.Decoder(Verdict)
# digest -> (verdict, monotonic expiry): a budget's verdict may be the machine's load,
# so it is kept a while only; a compiler's verdict is the schema's own, kept for good.
_cache: OrderedDict[bytes, tuple[GrammarError | None, float]] = OrderedDict()
_BUDGET_VERDICT_S = 300.0


def _cached(digest: bytes) -> tuple[GrammarError | None, bool]:
    """The cached verdict on `digest` and whether there is one still fresh."""
    entry = _cache.get(digest)
    if entry is None or entry[1] < time.monotonic():
        return None, False
    _cache.move_to_end(digest)
    return entry[0], True


def precheck(request: PlanRequest) -> None:
    """Refuse, in one walk of the schemas, what is too large to compile at all."""
    definitions = 0
    for i, tool in enumerate(request.tools):
        definitions += len(tool.definition.encode())
        if definitions > MAX_TOTAL_DEFINITION_BYTES:
            raise TooComplex(f"tools[{i}].format: the request's grammars are larger than "
                             f"{MAX_TOTAL_DEFINITION_BYTES} bytes in all")
    schemas = [(f"tools[{i}].function.parameters", t.parameters)
               for i, t in enumerate(request.tools) if t.kind != "custom"]
    fmt = request.response_format
    if fmt is not None and "schema" in fmt:
        schemas.append(("response_format.json_schema.schema", fmt["schema"]))
    total, chars = 0, 0
    for where, schema in schemas:
        size = len(_encode(schema))
        if size > MAX_SCHEMA_BYTES:
            raise GrammarError(f"{where} is larger than {MAX_SCHEMA_BYTES} bytes")
        total += size
        if total > MAX_TOTAL_SCHEMA_BYTES:
            raise TooComplex(f"{where}: the request's schemas are larger than "
                             f"{MAX_TOTAL_SCHEMA_BYTES} bytes in all")
        chars += _patterns(schema, where)
        if chars > MAX_PATTERN_CHARS:
            raise TooComplex(f"{where}: the request's patterns are longer than "
                             f"{MAX_PATTERN_CHARS} characters in all")


def _patterns(schema: Any, where: str) -> int:
    """The characters of the regexes under `schema`; TooComplex when an `allOf`
    intersects more than MAX_INTERSECTED_PATTERNS on one value (its branches' own, or
    those of one property across its branches). Iterative: a schema's depth is the
    caller's."""
    chars = 0
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        branches = node.get("allOf")
        if isinstance(branches, list) and _intersected(branches) > MAX_INTERSECTED_PATTERNS:
            raise TooComplex(f"{where}: an allOf intersects more than "
                             f"{MAX_INTERSECTED_PATTERNS} patterns")
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                chars += len(value)
            elif key == "patternProperties" and isinstance(value, dict):
                chars += sum(len(k) for k in value)
                stack.extend(value.values())
            elif key in ("properties", "$defs", "definitions") and isinstance(value, dict):
                stack.extend(value.values())
            elif isinstance(value, dict | list):
                stack.append(value)
    return chars


def _intersected(branches: list[Any]) -> int:
    """The most patterns `branches` (an allOf) apply to one value: the branches' own
    (nested allOfs flattened), or one property's across the branches."""
    on: dict[str, int] = {}
    stack = list(branches)
    while stack:
        branch = stack.pop()
        if not isinstance(branch, dict):
            continue
        if isinstance(branch.get("pattern"), str):
            on[""] = on.get("", 0) + 1
        if isinstance(branch.get("allOf"), list):
            stack.extend(branch["allOf"])
        props = branch.get("properties")
        for name, sub in (props.items() if isinstance(props, dict) else ()):
            if isinstance(sub, dict) and isinstance(sub.get("pattern"), str):
                on[name] = on.get(name, 0) + 1
    return max(on.values(), default=0)


class _Child:
    """One checking process and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def ask(self, line: bytes, budget_s: float) -> Verdict | None:
        """The child's verdict on `line`; None when it died or passed the budget."""
        assert self.proc.stdin is not None and self.proc.stdout is not None  # noqa: S101
        try:
            self.proc.stdin.write(line + b"\n")
            await self.proc.stdin.drain()
            answer = await asyncio.wait_for(self.proc.stdout.readline(), budget_s)
        except (TimeoutError, ConnectionError, BrokenPipeError):
            return None
        if not answer:
            return None
        try:
            return _verdicts.decode(answer)
        except msgspec.DecodeError:
            return None

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.proc.wait(), 5)


class GrammarChecker:
    """See the module docstring. `processes` children at most, started on demand."""

    def __init__(self, *, processes: int, budget_s: float, memory_mb: int) -> None:
        self.budget_s, self.memory_mb = budget_s, memory_mb
        self._idle: list[_Child] = []
        self._children: set[_Child] = set()  # idle and busy
        self._slots = asyncio.Semaphore(processes)
        self._tenants: weakref.WeakValueDictionary[str, asyncio.Lock] = \
            weakref.WeakValueDictionary()
        self.recycled = 0  # children killed for a verdict (tests, metrics)

    async def check(self, request: PlanRequest, *, tenant: str) -> None:
        """None when `request` compiles; else its GrammarError (TooComplex when it was
        too costly to decide). Precondition: `request` passed `precheck`."""
        line = _encode(request)
        digest = hashlib.sha256(line).digest()
        verdict, fresh = _cached(digest)
        if not fresh:
            lock = self._tenants.get(tenant)
            if lock is None:
                lock = self._tenants[tenant] = asyncio.Lock()
            async with lock, self._slots:
                verdict = await self._compile(line, digest)
        if verdict is not None:
            raise verdict

    async def _compile(self, line: bytes, digest: bytes) -> GrammarError | None:
        verdict, fresh = _cached(digest)
        if fresh:  # decided while this call waited its turn
            return verdict
        child = self._idle.pop() if self._idle else await self._spawn()
        try:
            answer = await child.ask(line, self.budget_s)
        except BaseException:  # cancelled mid-compile: the child may be busy for long
            await asyncio.shield(self._retire(child))
            raise
        if answer is None:
            self.recycled += 1
            await self._retire(child)
            verdict, keep_s = TooComplex(
                f"the schema is too complex to compile within {self.budget_s:g} s and "
                f"{self.memory_mb} MB"), _BUDGET_VERDICT_S
        else:
            self._idle.append(child)
            verdict = None if answer.error is None else GrammarError(answer.error)
            keep_s = float("inf")
        _cache[digest] = (verdict, time.monotonic() + keep_s)
        if len(_cache) > _CACHE_ENTRIES:
            _cache.popitem(last=False)
        return verdict

    async def _spawn(self) -> _Child:
        """A new child, once it has imported the compiler (its start-up, seconds on a
        busy machine, is not part of any check's budget)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "inference.structured.grammar_check", str(self.memory_mb),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, limit=1 << 20)
        child = _Child(proc)
        self._children.add(child)
        assert proc.stdout is not None  # noqa: S101
        try:
            ready = await asyncio.wait_for(proc.stdout.readline(), _START_S)
        except TimeoutError:
            ready = b""
        if ready.strip() != b"ready":
            await self._retire(child)
            raise GrammarUnavailable("the schema checker did not start")
        return child

    async def _retire(self, child: _Child) -> None:
        self._children.discard(child)
        await child.kill()

    async def close(self) -> None:
        """Kill every child, busy ones too (their checks end as TooComplex)."""
        self._idle = []
        await asyncio.gather(*(self._retire(child) for child in list(self._children)))


def _limit_memory(memory_mb: int) -> None:
    """Cap this process's address space at its size now plus `memory_mb`."""
    with open("/proc/self/statm") as statm:  # noqa: PTH123 - Linux only, as the platform
        size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = size + memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _serve(memory_mb: int) -> None:
    """The child: a verdict line for each request line, until stdin closes. Anything
    the compiler raises is a verdict; a Rust abort or a MemoryError ends the process
    (the parent sees no answer and replaces it)."""
    _limit_memory(memory_mb)
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        # A backstop for a parent that died mid-compile (nobody would kill this child):
        # the kernel ends a compile past a minute of CPU.
        used = resource.getrusage(resource.RUSAGE_SELF)
        cpu = int(used.ru_utime + used.ru_stime) + _CPU_BACKSTOP_S
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
        try:
            _requests.decode(line).compile()
            verdict = Verdict()
        except GrammarError as exc:
            verdict = Verdict(error=str(exc))
        except MemoryError:
            return
        except BaseException as exc:  # a Rust PanicException is a BaseException
            verdict = Verdict(error=f"the schema cannot be compiled ({type(exc).__name__})")
        out.write(_encode(verdict) + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
