"""Prices: versions by `valid_from` managed by platform admins and read by every role,
exact decimals from the API to a call's cost in nano-dollars, bad input refused with
nothing saved, and LiteLLM's price file imported without a float in between."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from governance import pricing
from governance.models import Price
from tenants.roles import Role
from tests.conftest import Org, assert_openai_error

pytestmark = pytest.mark.django_db

PA, TA, DEV, AUD = Role.PLATFORM_ADMIN, Role.TENANT_ADMIN, Role.DEVELOPER, Role.AUDITOR
URL = "/api/v1/governance/prices"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_a_platform_admin_adds_versions_every_role_reads_them_exactly(ops: Org,
                                                                       alice: Org) -> None:
    made = ops.client(PA).post(URL, {
        "model": "echo", "input_per_mtok_usd": "0.15", "output_per_mtok_usd": 0.6,
        "cached_input_per_mtok_usd": "0.075", "valid_from": T0.isoformat()})
    assert made.status == 201, made.body
    assert (made.body["input_per_mtok_usd"], made.body["output_per_mtok_usd"],
            made.body["cached_input_per_mtok_usd"]) == ("0.15", "0.6", "0.075")
    later = ops.client(PA).post(URL, {"model": "echo", "input_per_mtok_usd": "0.2",
                                      "output_per_mtok_usd": "0.8"})
    assert later.status == 201, later.body
    for role in (TA, DEV, AUD):
        listed = alice.client(role).get(f"{URL}?model=echo")
        assert listed.status == 200, listed.body
        assert [p["id"] for p in listed.body["items"]] == [later.body["id"], made.body["id"]]
        one = alice.client(role).get(f"{URL}/{made.body['id']}")
        assert one.status == 200 and one.body == made.body
    row = Price.objects.get(pk=made.body["id"])
    assert row.input_per_mtok_usd == Decimal("0.15") and row.gpu_second_usd is None


@pytest.mark.parametrize("role", [TA, DEV, AUD])
def test_only_platform_admins_write_prices(alice: Org, ops: Org, role: Role) -> None:
    body = {"model": "echo", "input_per_mtok_usd": 1, "output_per_mtok_usd": 1}
    assert_openai_error(alice.client(role).post(URL, body), 403)
    made = ops.client(PA).post(URL, body)
    assert_openai_error(alice.client(role).call("DELETE", f"{URL}/{made.body['id']}"), 403)
    assert Price.objects.count() == 1


@pytest.mark.parametrize(("change", "param"), [
    ({"input_per_mtok_usd": -1}, "input_per_mtok_usd"),
    ({"output_per_mtok_usd": "100000.000001"}, "output_per_mtok_usd"),
    ({"input_per_mtok_usd": "0.0000001"}, "input_per_mtok_usd"),  # seven places
    ({"input_per_mtok_usd": "NaN"}, "input_per_mtok_usd"),
    ({"input_per_mtok_usd": "Infinity"}, "input_per_mtok_usd"),
    ({"input_per_mtok_usd": "cheap"}, "input_per_mtok_usd"),
    ({"gpu_second_usd": 1001}, "gpu_second_usd"),
    ({"cached_input_per_mtok_usd": -0.5}, "cached_input_per_mtok_usd"),
    ({"model": ""}, "model"),
    ({"model": "a/b"}, "model"),
    ({"valid_from": "2026-01-01T00:00:00"}, "valid_from"),  # no offset
    ({"currency": "EUR"}, "currency"),
])
def test_bad_prices_are_422_and_save_nothing(ops: Org, change: dict[str, object],
                                             param: str) -> None:
    body = {"model": "echo", "input_per_mtok_usd": 1, "output_per_mtok_usd": 2, **change}
    error = assert_openai_error(ops.client(PA).post(URL, body), 422)
    assert error["param"] == param, error
    assert Price.objects.count() == 0


def test_a_second_version_from_the_same_time_is_409_and_another_ones_missing(
        ops: Org, alice: Org) -> None:
    body = {"model": "echo", "input_per_mtok_usd": 1, "output_per_mtok_usd": 2,
            "valid_from": T0.isoformat()}
    made = ops.client(PA).post(URL, body)
    error = assert_openai_error(ops.client(PA).post(URL, {**body, "input_per_mtok_usd": 3}),
                                409)
    assert error["param"] == "valid_from"
    assert Price.objects.get().input_per_mtok_usd == 1
    assert_openai_error(alice.client(DEV).get(f"{URL}/{made.body['id'] + 1000}"), 404)
    assert ops.client(PA).call("DELETE", f"{URL}/{made.body['id']}").status == 204
    assert_openai_error(alice.client(DEV).get(f"{URL}/{made.body['id']}"), 404)


def test_a_call_is_priced_by_the_version_valid_when_it_ran() -> None:
    Price.objects.create(model="m", input_per_mtok_usd=Decimal("1"),
                         output_per_mtok_usd=Decimal("2"), valid_from=T0)
    Price.objects.create(model="m", input_per_mtok_usd=Decimal("10"),
                         output_per_mtok_usd=Decimal("20"),
                         cached_input_per_mtok_usd=Decimal("5"),
                         valid_from=T0 + timedelta(days=31))
    assert pricing.cost_at("m", T0 - timedelta(seconds=1), 1000, 1000) is None
    assert pricing.cost_at("m", T0, 1000, 1000) == 3_000_000  # $0.003
    assert pricing.cost_at("m", T0 + timedelta(days=30), 1000, 1000) == 3_000_000
    # The new version from its first instant; cached input at its own price.
    assert pricing.cost_at("m", T0 + timedelta(days=31), 1000, 1000, cached=400) == (
        600 * 10_000 + 400 * 5_000 + 1000 * 20_000)
    assert pricing.cost_at("other", T0, 1, 1) is None


def test_costs_are_exact_integers_that_sum_without_drift() -> None:
    terms = pricing.Terms(T0, input=pricing.micros("0.15"), output=pricing.micros("0.6"),
                          cached_input=pricing.micros("0.075"))
    one = terms.cost(prompt=7, completion=0)  # 7 x $0.15 / 1e6 = $0.00000105
    assert one == 1050 and pricing.usd(one) == "0.000001050"
    assert pricing.usd(sum(one for _ in range(1_000_000))) == "1.050000000"
    float_sum = sum(0.00000105 for _ in range(1_000_000))
    assert float_sum != 1.05  # what a float total would have reported instead
    # A million calls of one token at $1 per million tokens: one dollar, exactly.
    dollar = pricing.Terms(T0, input=pricing.micros(1), output=0, cached_input=0)
    assert sum(dollar.cost(1, 0) for _ in range(1_000_000)) == pricing.NANO_PER_USD
    # The smallest price of the smallest call rounds up to a nano-dollar, once.
    tiny = pricing.Terms(T0, input=pricing.micros("0.000001"), output=0, cached_input=0)
    assert tiny.cost(1, 0) == 1 and tiny.cost(1000, 0) == 1 and tiny.cost(1001, 0) == 2
    with pytest.raises(ValueError):
        terms.cost(prompt=5, completion=1, cached=6)


LITELLM = """{
  "sample_spec": {"input_cost_per_token": 0.0, "output_cost_per_token": 0.0},
  "gpt-4o-mini": {"input_cost_per_token": 1.5e-07, "output_cost_per_token": 6e-07,
                  "cache_read_input_token_cost": 7.5e-08, "litellm_provider": "openai"},
  "openai/gpt-4o": {"input_cost_per_token": 2.5e-06, "output_cost_per_token": 1e-05},
  "dall-e-3": {"output_cost_per_image": 0.04},
  "claude-3-5-haiku": {"input_cost_per_token": 8e-07, "output_cost_per_token": 4e-06}
}"""


def test_importprices_reads_litellms_file_exactly(tmp_path: Path) -> None:
    path = tmp_path / "model_prices_and_context_window.json"
    path.write_text(LITELLM)
    call_command("importprices", str(path), "--valid-from", "2026-02-01T00:00:00Z")
    rows = {p.model: p for p in Price.objects.all()}
    assert set(rows) == {"gpt-4o-mini", "claude-3-5-haiku"}  # a slash, an image: skipped
    mini = rows["gpt-4o-mini"]
    assert (mini.input_per_mtok_usd, mini.output_per_mtok_usd,
            mini.cached_input_per_mtok_usd) == (Decimal("0.15"), Decimal("0.6"),
                                                Decimal("0.075"))
    assert mini.valid_from == datetime(2026, 2, 1, tzinfo=UTC)
    call_command("importprices", str(path), "--model", "gpt-4o=openai/gpt-4o",
                 "--valid-from", "2026-02-01T00:00:00Z")
    assert Price.objects.get(model="gpt-4o").output_per_mtok_usd == Decimal("10")
    # The same versions again: nothing changes; a named model not imported fails.
    with pytest.raises(CommandError):
        call_command("importprices", str(path), "--model", "gpt-4o=openai/gpt-4o",
                     "--valid-from", "2026-02-01T00:00:00Z")
    with pytest.raises(CommandError):
        call_command("importprices", str(path), "--model", "img=dall-e-3")
    assert Price.objects.count() == 3
    for bad in ("[]", "{not json"):
        path.write_text(bad)
        with pytest.raises(CommandError):
            call_command("importprices", str(path))
    assert json.loads(LITELLM)  # the fixture itself is well-formed JSON
