"""A reply kept with its request's final event (inference/jobs.py Keep): the worker's
writer gathers the events of a job that asks for it and keeps them with the final
event's write (KEEP_LUA), marking that final `kept_at`; it keeps only a whole reply it
made from the first event to a `done` one, and never one a deletion names."""

from __future__ import annotations

import msgspec
import orjson
import pytest
import redis

from inference import queue as q
from inference.engine.output import done_event
from inference.engine.writer import Writer
from inference.jobs import ChatJob, Event, Keep
from sluice.redis import is_cluster
from tests.inference.conftest import chat, unique
from tests.inference.test_engine_parts import request

pytestmark = pytest.mark.cluster


@pytest.fixture
def keep() -> Keep:
    tenant = unique("t")
    return Keep(key=f"test:{{{tenant}}}:kept:", deletions=f"test:{{{tenant}}}:gone:",
                stream=unique("test:kept-stream"), by="user-1", draft='{"any":"json"}',
                ttl_s=60, forget_s=60, maxlen=1000)


def kept_job(keep: Keep, text: str = "hello") -> ChatJob:
    return msgspec.structs.replace(chat(text), keep=keep)


def gateway_finals(rds: redis.Redis, gateway: str) -> list[dict[str, object]]:
    """The final events the gateway was told of."""
    items = [item for _id, f in rds.xrange(q.gateway_key(gateway))
             for item in orjson.loads(f[b"b"])]
    return [event for _rid, event in items if event["t"] in ("done", "error")]


def test_a_whole_reply_is_kept_with_its_final_event(rds: redis.Redis, keep: Keep) -> None:
    # Given a job that asks to keep its reply, written over two steps
    gateway = unique("gw")
    req = request(kept_job(keep), gateway=gateway)
    writer = Writer(rds, "echo", "w1")
    first: list[Event] = [{"t": "delta", "seq": 0, "text": "hel", "ids": [1, 2, 3]}]
    last: list[Event] = [{"t": "delta", "seq": 1, "text": "lo", "ids": [4, 5]},
                         done_event(2, "stop", prompt_tokens=5, completion_tokens=5)]
    writer.write([(req, e) for e in first], [])
    assert not rds.exists(keep.key + req.rid), "nothing kept before the final event"
    writer.write([(req, e) for e in last], [])
    # Then the copy holds who called, the draft and every event, the final marked
    copy = rds.hgetall(keep.key + req.rid)
    assert copy[b"by"] == b"user-1" and copy[b"draft"] == keep.draft.encode()
    assert copy[b"rid"] == req.rid.encode()
    reply = orjson.loads(copy[b"reply"])
    assert [e["seq"] for e in reply] == [0, 1, 2] and "".join(
        e.get("text", "") for e in reply) == "hello"
    assert isinstance(reply[-1]["kept_at"], int)
    assert 0 < rds.ttl(keep.key + req.rid) <= keep.ttl_s
    # and the writer's stream has it, and the gateway's final says it was kept
    [(_id, entry)] = rds.xrange(keep.stream)
    assert entry[b"reply"] == copy[b"reply"] and entry[b"by"] == b"user-1"
    [final] = gateway_finals(rds, gateway)
    assert final["kept_at"] == reply[-1]["kept_at"]
    writer.close(wait=True)


@pytest.mark.parametrize("ending", ["cancelled", "error", "not from the first event"])
def test_a_reply_that_is_not_whole_is_not_kept(rds: redis.Redis, keep: Keep,
                                               ending: str) -> None:
    gateway = unique("gw")
    req = request(kept_job(keep), gateway=gateway)
    writer = Writer(rds, "echo", "w1")
    seq = 1 if ending == "not from the first event" else 0  # a takeover's delivery
    final: Event = done_event(seq + 1, "cancelled" if ending == "cancelled" else "stop",
                              prompt_tokens=5, completion_tokens=1)
    if ending == "error":
        final = {"t": "error", "seq": seq + 1, "status": 504, "code": "deadline_exceeded",
                 "message": "late", "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
    writer.write([(req, {"t": "delta", "seq": seq, "text": "h", "ids": [1]}),
                  (req, final)], [])
    assert not rds.exists(keep.key + req.rid) and not rds.exists(keep.stream)
    [told] = gateway_finals(rds, gateway)
    assert "kept_at" not in told  # the gateway stores it itself
    writer.close(wait=True)


def test_a_reply_its_keepers_or_an_admins_deletion_names_is_not_kept(
        rds: redis.Redis, keep: Keep) -> None:
    writer = Writer(rds, "echo", "w1")
    for who in ("user-1", "*"):
        # Given a deletion of the id by its keeper or an admin, made while it ran
        req = request(kept_job(keep), gateway=unique("gw"))
        rds.sadd(keep.deletions + req.rid, who)
        # When its reply ends
        writer.write([(req, {"t": "delta", "seq": 0, "text": "h", "ids": [1]}),
                      (req, done_event(1, "stop", prompt_tokens=5, completion_tokens=1))],
                     [])
        # Then nothing is kept (nor queued, but on a cluster, where the stream's slot is
        # another: the writer's check after its INSERT drops it there), and the
        # deletion lasts as long as a kept one would
        assert not rds.exists(keep.key + req.rid)
        assert is_cluster(rds) or not rds.exists(keep.stream)
        assert 0 < rds.ttl(keep.deletions + req.rid) <= keep.forget_s
    # Another member's deletion does not stop it
    req = request(kept_job(keep), gateway=unique("gw"))
    rds.sadd(keep.deletions + req.rid, "user-2")
    writer.write([(req, {"t": "delta", "seq": 0, "text": "h", "ids": [1]}),
                  (req, done_event(1, "stop", prompt_tokens=5, completion_tokens=1))], [])
    [(_id, last)] = rds.xrevrange(keep.stream, count=1)
    assert rds.exists(keep.key + req.rid) and last[b"rid"] == req.rid.encode()
    writer.close(wait=True)


def test_a_job_without_keep_writes_nothing_more(rds: redis.Redis, keep: Keep) -> None:
    gateway = unique("gw")
    req = request(chat('say "keep"'), gateway=gateway)  # the word alone asks nothing
    writer = Writer(rds, "echo", "w1")
    writer.write([(req, {"t": "delta", "seq": 0, "text": "h", "ids": [1]}),
                  (req, done_event(1, "stop", prompt_tokens=5, completion_tokens=1))], [])
    [told] = gateway_finals(rds, gateway)
    assert "kept_at" not in told and not rds.exists(keep.key + req.rid)
    writer.close(wait=True)
