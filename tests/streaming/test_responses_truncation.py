"""The Responses API's `truncation: "auto"` against a live server and the small-context
toy model: a chain that outgrows the context is refused with truncation disabled (the
default) and answered with auto, the oldest turns dropped until the prompt fits, the
latest input kept whole; through an alias too."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from inference.selectors import clear_routes
from inference.services import alias_create
from tenants.roles import Role
from tests.conftest import make_org, principal_for
from tests.streaming.conftest import Live
from tests.streaming.test_choices import org, sdk  # noqa: F401  (a fixture, a client)

pytestmark = pytest.mark.slow
LONG = "apple " * 110  # about half of the toy model's 256-token context


def test_auto_drops_the_oldest_turns_until_the_prompt_fits(
        live: Live, org: Any, tiny: str) -> None:  # noqa: F811
    client = sdk(live, org)
    # Given a first turn that took half the context
    first = client.responses.create(model=tiny, input=LONG, max_output_tokens=4,
                                    temperature=0)
    assert first.usage is not None
    # When a second as long continues it, Then without truncation it does not fit
    with pytest.raises(openai.BadRequestError) as overflow:
        client.responses.create(model=tiny, input=LONG, previous_response_id=first.id,
                                max_output_tokens=4)
    assert overflow.value.code == "context_length_exceeded"
    # and with truncation auto the oldest messages are dropped (the first input; its
    # short reply still fits): the new input whole, within the context
    fitted = client.responses.create(model=tiny, input=LONG, previous_response_id=first.id,
                                     max_output_tokens=4, truncation="auto", temperature=0)
    assert fitted.status in ("completed", "incomplete") and fitted.truncation == "auto"
    assert fitted.usage is not None
    assert first.usage.input_tokens < fitted.usage.input_tokens <= 256 - 4


def test_auto_keeps_what_fits(live: Live, org: Any, tiny: str) -> None:  # noqa: F811
    client = sdk(live, org)
    first = client.responses.create(model=tiny, input="My name is Ada.",
                                    max_output_tokens=4, temperature=0)
    asked = {"model": tiny, "input": "And yours?", "previous_response_id": first.id,
             "max_output_tokens": 4, "temperature": 0}
    kept = client.responses.create(**asked, truncation="auto")
    whole = client.responses.create(**asked)
    # Nothing needed dropping: the prompt is the whole chain, as without truncation
    assert kept.usage is not None and whole.usage is not None and first.usage is not None
    assert kept.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens


def test_auto_through_an_alias_plans_deployments_that_hold_the_trimmed_call(
        live: Live, org: Any, tiny: str) -> None:  # noqa: F811
    # Given an alias whose one deployment is the 256-token toy model, and a turn whose
    # text routing bounds at most of that context (a token per byte: 180 bytes)
    admin = principal_for(make_org("ops", [Role.PLATFORM_ADMIN]).members[Role.PLATFORM_ADMIN])
    alias_create(actor=admin, name="org/tiny", targets=[(tiny, 1)])
    clear_routes()
    client = sdk(live, org)
    turn = "apple " * 30
    first = client.responses.create(model="org/tiny", input=turn, max_output_tokens=4,
                                    temperature=0)
    # When a second such turn continues it with truncation auto (the chain's bound, over
    # the context, is only the worker's to trim)
    second = client.responses.create(model="org/tiny", input=turn, max_output_tokens=4,
                                     previous_response_id=first.id, truncation="auto",
                                     temperature=0)
    # Then the deployment answers it, as a call to it by name would be answered
    assert second.usage is not None and first.usage is not None
    assert first.usage.input_tokens < second.usage.input_tokens <= 256 - 4
