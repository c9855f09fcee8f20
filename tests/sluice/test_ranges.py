"""Numbers and text at the management API's edge: every integer query parameter has a
documented range and a value outside it is a 422 naming the parameter (never an
overflow in the database driver: a 500); every free-text field of a request body
refuses control characters (a NUL cannot be stored in PostgreSQL text).

The operations are read from the API's own OpenAPI document, so an endpoint added
later is covered without touching this file."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from sluice.root.api import api
from sluice.schemas import MAX_ID
from tenants.models import ApiKey, Conversation
from tenants.roles import Role
from tests.conftest import Org, assert_openai_error

pytestmark = pytest.mark.django_db

# Overflows a 64-bit integer; a digit str.isdigit accepts and int() refuses; a number
# longer than Python's int() takes from text (4,300 digits); negative.
BAD_NUMBERS = ["99999999999999999999", "9223372036854775808", "\u00b2", "9" * 4301, "-1"]
# The OpenAI inference routes' bodies are the model's input, not stored management data.
# Prompts, not management data: a model's input may hold any character (what is stored
# from them is redacted and NUL-safe where it is stored).
INFERENCE_BODIES = {"/v1/chat/completions", "/v1/embeddings", "/v1/completions",
                    "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"}
# A password is hashed, never stored as text; the UI takes any character but NUL too.
NOT_TEXT = {"password"}


def _document() -> dict[str, Any]:
    return api.get_openapi_schema()


def _integer(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The integer branch of a parameter's schema (`int | None` is an anyOf)."""
    for branch in [schema, *schema.get("anyOf", [])]:
        if branch.get("type") == "integer":
            return branch
    return None


def _list_operations() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(path, parameters) of every GET without path parameters: the lists."""
    for path, operations in _document()["paths"].items():
        get = operations.get("get")
        if get is not None and "{" not in path:
            yield path, get.get("parameters", [])


def _integer_query_parameters() -> list[tuple[str, str]]:
    return [(path, p["name"]) for path, params in _list_operations() for p in params
            if p["in"] == "query" and _integer(p["schema"]) is not None]


def test_every_list_declares_its_paging_and_ids_as_integers() -> None:
    # Guards the parametrization below: it must see the lists' numbers.
    found = set(_integer_query_parameters())
    assert ("/api/v1/keys", "offset") in found
    assert ("/api/v1/governance/rate-limits", "tenant_id") in found
    assert ("/api/v1/audit/events", "status") in found


def test_every_integer_query_parameter_documents_its_range() -> None:
    # Given the OpenAPI document, when each operation's integer query parameters are
    # read, then each has a minimum and a maximum a 64-bit signed integer holds.
    for path, operations in _document()["paths"].items():
        for method, operation in operations.items():
            for param in operation.get("parameters", []):
                number = _integer(param["schema"]) if param["in"] == "query" else None
                if number is None:
                    continue
                where = f"{method.upper()} {path} ?{param['name']}"
                assert "minimum" in number and "maximum" in number, where
                assert -MAX_ID - 1 <= number["minimum"] <= number["maximum"] <= MAX_ID, where


@pytest.mark.parametrize(("path", "name"), _integer_query_parameters())
def test_an_integer_query_parameter_out_of_range_is_a_422_naming_it(
        ops: Org, path: str, name: str) -> None:
    client = ops.client(Role.PLATFORM_ADMIN)
    for value in BAD_NUMBERS:
        error = assert_openai_error(client.get(f"{path}?{name}={value}"), 422)
        assert error["param"] == name, (path, value, error)
        assert name in error["message"]


@pytest.mark.parametrize("path", [path for path, _params in _list_operations()])
def test_offset_and_tenant_id_overflow_never_reach_the_database(ops: Org, path: str) -> None:
    # Given any list, when a platform admin sends the probe's overflowing numbers, then
    # it is a 4xx naming one of them (a list that declares it), or the list (one that
    # takes neither): never a server error.
    client = ops.client(Role.PLATFORM_ADMIN)
    big = "99999999999999999999"
    for query in (f"offset={big}", f"tenant_id={big}", f"offset={big}&tenant_id={big}"):
        response = client.get(f"{path}?{query}")
        assert response.status < 500, (path, query, response.body)
        if response.status >= 400:
            assert assert_openai_error(response, response.status)["param"] in (
                "offset", "tenant_id"), (path, query, response.body)


def test_a_valid_offset_still_pages(alice: Org) -> None:
    client = alice.client(Role.TENANT_ADMIN)
    page = client.get("/api/v1/keys?limit=1&offset=1").body
    assert page["count"] == 3 and len(page["items"]) == 1
    assert client.get("/api/v1/keys?offset=1000000000").body["items"] == []


# -- text ----------------------------------------------------------------------------
def _resolve(schema: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    node: Any = doc
    for part in ref.lstrip("#/").split("/"):
        node = node[part]
    return _resolve(node, doc)


def _strings(schema: dict[str, Any], doc: dict[str, Any], where: str,
             seen: frozenset[str] = frozenset()) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, schema) of every string a request body may carry, keys of maps too."""
    ref = schema.get("$ref")
    if ref in seen:
        return
    seen = seen | {ref} if ref else seen
    schema = _resolve(schema, doc)
    for branch in schema.get("anyOf", []) + schema.get("oneOf", []) + schema.get("allOf", []):
        yield from _strings(branch, doc, where, seen)
    if schema.get("type") == "string":
        yield where, schema
    for name, prop in schema.get("properties", {}).items():
        yield from _strings(prop, doc, f"{where}.{name}", seen)
    if isinstance(schema.get("additionalProperties"), dict):
        if "propertyNames" in schema:
            yield from _strings(schema["propertyNames"], doc, f"{where}.<key>", seen)
        else:
            yield f"{where}.<key>", {"type": "string"}
        yield from _strings(schema["additionalProperties"], doc, f"{where}.<value>", seen)
    if isinstance(schema.get("items"), dict):
        yield from _strings(schema["items"], doc, f"{where}[]", seen)


def test_every_free_text_field_of_a_request_body_refuses_control_characters() -> None:
    # Given the OpenAPI document, when every string a management request body carries
    # is read, then each is a choice, a format, or a pattern that refuses a NUL and an
    # escape character.
    doc = _document()
    open_text = []
    for path, operations in doc["paths"].items():
        if path in INFERENCE_BODIES:
            continue
        for method, operation in operations.items():
            for media in operation.get("requestBody", {}).get("content", {}).values():
                for where, schema in _strings(media["schema"], doc, f"{method} {path}"):
                    if where.rsplit(".", 1)[-1] in NOT_TEXT or "enum" in schema or \
                            "const" in schema or "format" in schema:
                        continue
                    pattern = schema.get("pattern")
                    if pattern is None or any(re.search(pattern, f"a{c}b")
                                              for c in ("\x00", "\x1b")):
                        open_text.append(where)
    assert open_text == []


def test_a_nul_in_a_key_name_is_a_422_naming_it_and_nothing_is_stored(alice: Org) -> None:
    before = ApiKey.objects.count()
    for name in ("bad\x00name", "bad\x1bname", "line\nbreak"):
        error = assert_openai_error(alice.client(Role.TENANT_ADMIN).post(
            "/api/v1/keys", {"name": name}), 422)
        assert error["param"] == "name" and error["code"] == "control_character"
    assert ApiKey.objects.count() == before
    ok = alice.client(Role.TENANT_ADMIN).post("/api/v1/keys", {"name": "Grüße \u2603 prod"})
    assert ok.status == 201 and ok.body["name"] == "Grüße \u2603 prod"


def test_a_nul_in_a_conversation_title_is_a_422_naming_it_and_nothing_is_stored(
        alice: Org) -> None:
    client = alice.client(Role.DEVELOPER)
    error = assert_openai_error(client.post("/api/v1/conversations", {"title": "a\x00b"}), 422)
    assert error["param"] == "title" and "control characters" in error["message"]
    assert not Conversation.objects.exists()
    assert client.post("/api/v1/conversations", {"title": "Notes \u00e9t\u00e9"}).status == 201
