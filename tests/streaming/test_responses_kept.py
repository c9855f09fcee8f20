"""A stored response kept by the worker with its request's final event (the common
case: streaming/apis/responses/copy.py): what Redis holds, what readers and the writer make
of it (the response object its caller got, redacted per the tenant's policy), over the
official client against a live server. The gateway's own save (a reply the worker did
not keep) is in test_responses_store.py."""

from __future__ import annotations

import json

import openai
import pytest

from sluice.redis import sync_redis
from streaming.apis.responses import writer as responses_writer
from streaming.apis.responses.copy import copy_key
from streaming.models import StoredResponse
from tenants.roles import Role
from tests.conftest import Org, make_org
from tests.streaming.conftest import Live

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
SSN = "536-42-7151"


@pytest.fixture
def org(live: Live) -> Org:
    return make_org("alice", [Role.DEVELOPER])


@pytest.fixture
def client(live: Live, org: Org) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key=org.keys[Role.DEVELOPER],
                         max_retries=0, timeout=60)


def kept(org: Org, response_id: str) -> dict[bytes, bytes]:
    return sync_redis().hgetall(copy_key(org.tenant.pk, response_id))


def test_a_plain_and_a_streamed_reply_are_kept_as_their_callers_got_them(
        client: openai.OpenAI, org: Org) -> None:
    # When a plain and a streamed response are stored
    plain = client.responses.create(model="echo", input="kept plainly",
                                    metadata={"topic": "demo"}, instructions="Be brief.")
    streamed = list(client.responses.create(model="echo", input="kept as it streamed",
                                            stream=True))[-1].response
    # Then the worker kept each (a draft and the reply's events, no row of the gateway's)
    for response in (plain, streamed):
        copy = kept(org, response.id)
        assert {b"by", b"draft", b"reply", b"rid"} <= copy.keys() and b"row" not in copy
        # and reading the copy gives the response object its caller got
        assert client.responses.retrieve(response.id) == response
    # and so does the database's row, once the writer wrote it and dropped the copy
    assert responses_writer.drain() >= 2
    for response in (plain, streamed):
        assert not kept(org, response.id)
        assert client.responses.retrieve(response.id) == response
    assert client.responses.retrieve(plain.id).completed_at == plain.completed_at


def test_a_kept_reply_is_redacted_when_read_and_when_written(client: openai.OpenAI,
                                                             org: Org) -> None:
    # Given the tenant's default policy (stored data redacted)
    response = client.responses.create(model="echo", input=f"My SSN is {SSN}",
                                       metadata={"who": SSN})
    assert response.output_text == f"My SSN is {SSN}"  # the caller's own reply
    # When it is read before the writer ran (from the worker's copy), Then redacted
    early = client.responses.retrieve(response.id)
    assert early.output_text == "My SSN is [SSN]" and early.metadata == {"who": "[SSN]"}
    items = client.responses.input_items.list(response.id).data
    assert SSN not in items[0].model_dump_json() and "[SSN]" in items[0].model_dump_json()
    # and a next call continues from the redacted turn
    follow = client.responses.create(model="echo", previous_response_id=response.id,
                                     input="again")
    assert follow.usage is not None
    # When the writer writes it, Then the database holds none of it raw
    responses_writer.drain()
    row = StoredResponse.objects.values().get(public_id=response.id)
    stored = json.dumps(row, default=str)
    assert SSN not in stored and stored.count("[SSN]") == 3
    assert client.responses.retrieve(response.id) == early
