"""The guardrails' parts without a server: the precedence of policies, the span guards,
the runner's actions and failure modes, and the hold-back that never lets a masked or
blocked string out, however a reply is split into chunks."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from governance.guardrails.guards import Context, Guard, PiiGuard, Verdict, WordsGuard
from governance.guardrails.holdback import Held
from governance.guardrails.policy import Policy, Rule, applied
from governance.guardrails.runner import Blocked, Verdicts, run

CTX = Context(tenant="t", key_prefix="sk-x", model="echo", phase="pre")


def policy(pid: int = 1, **kw: Any) -> Policy:
    fields: dict[str, Any] = {
        "id": pid, "name": f"p{pid}", "guard": "pii", "phase": "pre", "action": "mask",
        "scope": "tenant", "tenant_id": 1, "key_id": None, "deployment": "",
        "categories": (), "config": {}}
    fields.update(kw)
    return Policy(**fields)


def names(rules: tuple[Rule, ...]) -> list[str]:
    return [r.policy.name for r in rules]


# -- precedence ------------------------------------------------------------------------
def test_the_most_specific_scope_wins_per_guard_and_phase() -> None:
    platform = policy(1, scope="platform", tenant_id=None, action="block")
    tenant = policy(2, scope="tenant", action="mask")
    deployment = policy(3, scope="deployment", deployment="echo", action="flag")
    key = policy(4, scope="key", key_id=7, action="flag")
    other_key = policy(5, scope="key", key_id=8, action="block")
    words = policy(6, guard="words", scope="platform", tenant_id=None,
                   config={"deny": ["x"]})
    every = [platform, tenant, deployment, key, other_key, words]
    build = lambda p: p  # noqa: E731 - the guard does not matter here
    assert names(applied(every, key_id=7, model="echo", build=build).pre) == ["p4", "p6"]
    assert names(applied(every, key_id=9, model="echo", build=build).pre) == ["p3", "p6"]
    assert names(applied(every, key_id=9, model="minilm", build=build).pre) == ["p2", "p6"]
    assert names(applied([platform], key_id=None, model="x", build=build).pre) == ["p1"]
    # A tenant's own policy of a scope before the platform's of the same scope.
    mine = policy(9, scope="deployment", deployment="echo")
    theirs = policy(10, scope="deployment", deployment="echo", tenant_id=None)
    assert names(applied([theirs, mine], key_id=None, model="echo",
                         build=build).pre) == ["p9"]


def test_a_mandatory_platform_policy_cannot_be_weakened_or_switched_off() -> None:
    mandatory = policy(1, scope="platform", tenant_id=None, action="block", mandatory=True)
    off_for_key = policy(2, scope="key", key_id=7, enabled=False)
    got = applied([mandatory, off_for_key], key_id=7, model="echo", build=lambda p: p)
    assert names(got.pre) == ["p1"]
    # A disabled policy switches a (non-mandatory) guard off for its scope.
    tenant = policy(3, action="block")
    assert not applied([tenant, off_for_key], key_id=7, model="echo", build=lambda p: p)
    # A mandatory flag on a tenant's own row means nothing: only the platform's bind.
    assert names(applied([policy(4, mandatory=True), policy(5, scope="key", key_id=7)],
                         key_id=7, model="echo", build=lambda p: p).pre) == ["p5"]


# -- guards ----------------------------------------------------------------------------
def test_pii_guard_finds_categories_and_tenant_patterns() -> None:
    import re
    guard = PiiGuard((), (("EMPLOYEE", re.compile(r"EMP-\d{6}")),))
    text = "mail jane@example.com, card 4111 1111 1111 1111, badge EMP-123456"
    assert [f.category for f in guard.find(text)] == ["EMAIL", "CARD", "EMPLOYEE"]
    assert [f.category for f in PiiGuard(("card",), ()).find(text)] == ["CARD"]


def test_words_guard_denies_whole_words_except_where_allowed() -> None:
    guard = WordsGuard({"deny": ["kill", "drop table"], "allow": ["kill the process"],
                        "deny_regex": [r"proj-[a-z]{4}"]}, "DENIED")
    found = guard.find("Kill it. skill. kill the process. DROP TABLE users; proj-abcd")
    text = "Kill it. skill. kill the process. DROP TABLE users; proj-abcd"
    assert [text[f.start:f.end] for f in found] == ["Kill", "DROP TABLE", "proj-abcd"]


# -- the runner ------------------------------------------------------------------------
class Slow(Guard):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def check(self, texts: Any, ctx: Context) -> Verdict:
        await asyncio.sleep(self.seconds)
        return Verdict(False)


class Failing(Guard):
    async def check(self, texts: Any, ctx: Context) -> Verdict:
        raise ConnectionError("down")


def test_runner_masks_blocks_flags_and_shadows() -> None:
    pii = PiiGuard((), ())
    text = ["reach me at jane@example.com"]
    verdicts = Verdicts()
    assert asyncio.run(run([Rule(policy(1), pii)], text, CTX, verdicts)) == \
        ["reach me at [EMAIL]"]
    assert asyncio.run(run([Rule(policy(2, action="flag"), pii)], text, CTX, verdicts)) \
        == text
    assert asyncio.run(run([Rule(policy(3, action="block", shadow=True), pii)], text,
                           CTX, verdicts)) == text
    with pytest.raises(Blocked) as blocked:
        asyncio.run(run([Rule(policy(4, action="block"), pii)], text, CTX, verdicts))
    assert blocked.value.policy.name == "p4"
    summary = verdicts.summary()
    assert "p1/pre=mask:EMAIL@" in summary and "p2/pre=flag:EMAIL@" in summary
    assert "p3/pre=shadow:EMAIL@" in summary and "jane" not in summary


def test_a_guard_that_fails_or_times_out_follows_its_failure_mode() -> None:
    for guard in (Failing(), Slow(5)):
        opened = policy(1, guard="webhook", timeout_s=0.05, on_error="open")
        assert asyncio.run(run([Rule(opened, guard)], ["hi"], CTX, Verdicts())) == ["hi"]
        closed = policy(2, guard="webhook", timeout_s=0.05, on_error="closed")
        with pytest.raises(Blocked) as blocked:
            asyncio.run(asyncio.wait_for(run([Rule(closed, guard)], ["hi"], CTX,
                                             Verdicts()), 2))
        assert blocked.value.why == "error"
        shadow = policy(3, guard="webhook", timeout_s=0.05, on_error="closed", shadow=True)
        assert asyncio.run(run([Rule(shadow, guard)], ["hi"], CTX, Verdicts())) == ["hi"]


# -- the hold-back ---------------------------------------------------------------------
SECRETS = ["jane.doe@example.com", "4111 1111 1111 1111", "sk-live-AbCdEf0123456789xyz",
           "forbidden", "GB82 WEST 1234 5698 7654 32",
           "sk-" + "Ab0Cd1Ef2Gh3" * 12]  # longer than a window: held while it grows
FILLER = st.text(alphabet="abc xyz.,\n", max_size=60)


async def _streamed(rules: list[Rule], chunks: list[str], window: int
                    ) -> tuple[list[str], bool]:
    held = Held(rules, CTX._replace(phase="post"), Verdicts(), window=window)
    out: list[str] = []
    try:
        for chunk in chunks:
            out.append(await held.feed(chunk))
        out.append(await held.end())
    except Blocked:
        return out, True
    return out, False


def _chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.tuples(FILLER, st.sampled_from(SECRETS)), min_size=1, max_size=4),
       tail=FILLER, cuts=st.lists(st.integers(0, 10_000), max_size=40),
       window=st.sampled_from([32, 64, 128]))
def test_no_chunking_lets_a_masked_string_out(parts: list[tuple[str, str]], tail: str,
                                              cuts: list[int], window: int) -> None:
    text = "".join(f"{filler} {secret} " for filler, secret in parts) + tail
    rules = [Rule(policy(1, phase="post"), PiiGuard((), ())),
             Rule(policy(2, guard="words", phase="post"),
                  WordsGuard({"deny": ["forbidden"]}, "DENIED"))]
    out, blocked = asyncio.run(_streamed(rules, _chunked(text, cuts), window))
    assert not blocked
    sent = "".join(out)
    for secret in SECRETS:
        assert secret not in sent
        # ... nor any piece of it that a chunk boundary could have cut off
        assert not any(secret[:k] in c and len(secret[:k]) > 6 for c in out
                       for k in range(7, len(secret)))
    # The same text as masking the whole reply at once.
    whole, _ = asyncio.run(_streamed(rules, [text], window))
    assert sent == "".join(whole)


@settings(max_examples=100, deadline=None)
@given(before=FILLER, after=FILLER, cuts=st.lists(st.integers(0, 10_000), max_size=30))
def test_a_blocked_string_never_leaves_and_the_stream_stops(before: str, after: str,
                                                           cuts: list[int]) -> None:
    text = f"{before} forbidden {after}"
    rules = [Rule(policy(1, guard="words", phase="post", action="block"),
                  WordsGuard({"deny": ["forbidden"]}, "DENIED"))]
    out, blocked = asyncio.run(_streamed(rules, _chunked(text, cuts), 32))
    assert blocked
    assert "forb" not in "".join(out)
    assert text.startswith("".join(out))


def test_text_is_released_once_the_window_fills() -> None:
    rules = [Rule(policy(1, phase="post"), PiiGuard((), ()))]

    async def first_release() -> int:
        held = Held(rules, CTX, Verdicts(), window=16)
        for n, ch in enumerate("x" * 100):
            if await held.feed(ch):
                return n + 1
        return -1
    assert asyncio.run(first_release()) == 17  # the window plus one character
