"""The gateway's bounded grammar checks (inference/structured/grammar_check.py): cheap refusals of
the obvious bombs, a budget and a memory cap that end a child which compiles too long,
verdicts cached, one tenant's check never in front of another's. Real child processes
and the real llguidance compiler."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from inference.structured import grammar_check
from inference.structured.grammar import GrammarError, Tool
from inference.structured.grammar_check import GrammarChecker, PlanRequest, TooComplex, precheck


def bomb(n: int, *, salt: str = "") -> dict[str, Any]:
    """The probe's schema: one string whose allOf intersects `n` search patterns."""
    return {"type": "object", "properties": {"x": {"type": "string", "allOf": [
        {"pattern": f".*{chr(97 + i % 26)}{i}{salt}.*"} for i in range(n)]}},
        "required": ["x"]}


def tools(schema: dict[str, Any]) -> PlanRequest:
    return PlanRequest(tools=[Tool("f", schema)])


PLAIN = tools({"type": "object", "properties": {"a": {"type": "string"}}})


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    grammar_check._cache.clear()
    yield
    grammar_check._cache.clear()


def test_the_probes_bomb_is_refused_without_compiling() -> None:
    for n in (9, 18, 30, 200):
        with pytest.raises(TooComplex, match="intersects more than 8 patterns"):
            precheck(tools(bomb(n)))
    precheck(tools(bomb(8)))  # within the bound: left to the compiler
    across = {"allOf": [{"properties": {"x": {"type": "string", "pattern": f"a{i}"}}}
                        for i in range(9)]}
    with pytest.raises(TooComplex):  # one property's patterns across the branches
        precheck(tools(across))
    apart = {"allOf": [{"properties": {f"x{i}": {"type": "string", "pattern": f"a{i}"}}}
                       for i in range(20)]}
    precheck(tools(apart))  # twenty patterns, each on its own value


def test_sizes_across_a_request_are_bounded() -> None:
    # 60 tools x 2,000 optional properties (3.4 MB): each tool under 100 KB alone
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                              for i in range(2000)}}
    with pytest.raises(TooComplex, match="larger than 262144 bytes in all"):
        precheck(PlanRequest(tools=[Tool(f"t{i}", wide) for i in range(60)]))
    with pytest.raises(TooComplex, match="patterns are longer"):
        precheck(tools({"type": "object", "properties": {
            f"p{i}": {"type": "string", "pattern": "a" * 900} for i in range(20)}}))
    with pytest.raises(GrammarError, match="larger than 100000 bytes"):
        precheck(tools({"type": "object", "properties": {
            f"p{i}": {"type": "string", "description": "d" * 1000} for i in range(120)}}))


def test_a_compile_over_budget_is_too_complex_and_its_child_replaced() -> None:
    # Past the pre-check's bound (not applied here), 22 patterns take minutes to compile.

    async def go() -> None:
        checker = GrammarChecker(processes=1, budget_s=1.0, memory_mb=4096)
        try:
            await checker.check(PLAIN, tenant="a")  # a child started and warm
            began = time.monotonic()
            with pytest.raises(TooComplex, match="within 1 s"):
                await checker.check(tools(bomb(22)), tenant="a")
            assert checker.recycled == 1
            assert time.monotonic() - began < 30  # the budget ended it, not the compile
            # the verdict is remembered: the same bomb again costs no child
            with pytest.raises(TooComplex):
                await checker.check(tools(bomb(22)), tenant="a")
            assert checker.recycled == 1
            # and the next schema gets a fresh child
            await checker.check(tools({"type": "object", "properties": {
                "b": {"type": "integer"}}}), tenant="a")
        finally:
            await checker.close()

    asyncio.run(go())


def test_a_child_out_of_memory_is_too_complex_and_replaced() -> None:

    async def go() -> None:
        checker = GrammarChecker(processes=1, budget_s=600, memory_mb=64)
        try:
            with pytest.raises(TooComplex):  # ~2 GB wanted: the child dies of it
                await checker.check(tools(bomb(24, salt="m")), tenant="a")
            assert checker.recycled == 1
            await checker.check(PLAIN, tenant="a")
        finally:
            await checker.close()

    asyncio.run(go())


def test_an_invalid_schema_is_the_compilers_error_and_cached() -> None:
    async def go() -> None:
        checker = GrammarChecker(processes=1, budget_s=30, memory_mb=512)
        try:
            for _ in range(2):
                with pytest.raises(GrammarError, match="tools\\[0\\]") as caught:
                    await checker.check(tools({"type": "object", "properties": {
                        "xs": {"not": {"type": "string"}}}}), tenant="a")
                assert not isinstance(caught.value, TooComplex)
            assert checker.recycled == 0 and len(grammar_check._cache) == 1
        finally:
            await checker.close()

    asyncio.run(go())


def test_one_tenants_bomb_does_not_wait_in_front_of_another_tenant() -> None:

    async def go() -> None:
        checker = GrammarChecker(processes=2, budget_s=600, memory_mb=4096)
        try:
            # tenant a: a compile that runs for minutes, and a second one queued behind
            first = asyncio.create_task(checker.check(tools(bomb(22, salt="1")), tenant="a"))
            second = asyncio.create_task(checker.check(tools(bomb(22, salt="2")),
                                                       tenant="a"))
            await asyncio.sleep(0)
            # tenant b's schema is decided meanwhile, on the other child
            await checker.check(PLAIN, tenant="b")
            assert not first.done() and not second.done()
        finally:
            await checker.close()  # ends the running compile
            for task in (first, second):
                task.cancel()
            await asyncio.gather(first, second, return_exceptions=True)

    asyncio.run(go())
