"""A job's `resume` on the upstream worker (what a model alias's call sends its next
deployment after the first one's upstream died mid-reply: streaming/pipeline/routed.py): the
worker continues after it, numbering its events on from its `seq`, and a takeover of
such a request continues after both what the job carried and what it streamed. The
upstream is the live Sluice's slow echo, which answers with its prompt."""

from __future__ import annotations

import pytest
import redis
from django.conf import settings

from inference.jobs import ChatJob, Continuation
from tests.conftest import Org
from tests.inference.conftest import ProcessWorkers, run
from tests.inference.test_upstream_worker import killed_mid_reply, org, upstream_spec  # noqa: F401  (org: a fixture)
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

PROMPT = "The quick brown fox jumps over the lazy dog."
CARRIED = Continuation(text="The quick", seq=9, completion_tokens=9)


def test_a_resumed_job_taken_over_continues_after_both(
        live: Live, org: Org, process_workers: ProcessWorkers,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch, rds: redis.Redis) -> None:
    monkeypatch.setenv("SLUICE_UPSTREAM_ALLOW_PRIVATE", "true")
    spec = upstream_spec(live, org, "slow-echo")
    first = process_workers.start(spec)
    process_workers.wait_live(rds, "up", 1)

    result = run(killed_mid_reply(process_workers, first, spec, ChatJob(
        prompt=PROMPT, max_tokens=500, resume=CARRIED), next_seq=CARRIED.seq),
        settings.REDIS_URL)
    assert result.final["t"] == "done", result.final
    assert [e["seq"] for e in result.events] == \
        list(range(CARRIED.seq, CARRIED.seq + len(result.events)))
    # The first worker sent PROMPT + CARRIED and streamed S (its start) before it died;
    # the takeover sent PROMPT + CARRIED + S: the echo answers with that prompt.
    carried = PROMPT + CARRIED.text
    size, odd = divmod(len(result.text) - len(carried), 2)
    streamed = result.text[:size]
    assert not odd and size >= 8 and carried.startswith(streamed)
    assert result.text == streamed + carried + streamed
    # Billed once: the carried text, S, then the upstream's own count.
    assert result.final["usage"]["completion_tokens"] == CARRIED.completion_tokens + \
        len(result.text)
    assert result.final["usage"]["prompt_tokens"] == len(PROMPT)
