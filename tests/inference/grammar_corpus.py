"""Thirty-odd JSON schemas of the kinds agent frameworks and pydantic generate, for the
structured-generation tests (tests/inference/test_grammar.py)."""

from __future__ import annotations

from typing import Any

ITEM = {"type": "object", "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
    "required": ["sku", "qty"], "additionalProperties": False}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "properties": {"city": {"type": "string"},
                                              "days": {"type": "integer"}},
             "required": ["city", "days"]},
    "enum": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
             "required": ["unit"]},
    "const": {"type": "object", "properties": {"kind": {"const": "order"},
                                               "n": {"type": "integer"}},
              "required": ["kind", "n"]},
    "string_array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 4}}, "required": ["tags"]},
    "object_array": {"type": "object", "properties": {
        "items": {"type": "array", "items": ITEM, "minItems": 1, "maxItems": 3}},
        "required": ["items"], "additionalProperties": False},
    "prefix_items": {"type": "object", "properties": {
        "point": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}],
                  "items": False}}, "required": ["point"]},
    "min_max_items": {"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                "maxItems": 2}}, "required": ["ids"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {"type": "object", "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["FR", "DE", "US"]}},
                "required": ["zip", "country"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "defs_ref": {"$defs": {"Item": ITEM}, "type": "object", "properties": {
        "first": {"$ref": "#/$defs/Item"}, "second": {"$ref": "#/$defs/Item"}},
        "required": ["first"]},
    "recursive": {"$defs": {"Node": {"type": "object", "properties": {
        "value": {"type": "integer"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2}},
        "required": ["value"], "additionalProperties": False}},
        "$ref": "#/$defs/Node"},
    "any_of_null": {"type": "object", "properties": {
        "note": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]}},
        "required": ["note"]},
    "type_list_null": {"type": "object", "properties": {
        "count": {"type": ["integer", "null"]}}, "required": ["count"]},
    "one_of": {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"r": {"type": "number", "minimum": 0}},
         "required": ["r"], "additionalProperties": False},
        {"type": "object", "properties": {"w": {"type": "integer"}, "h": {"type": "integer"}},
         "required": ["w", "h"], "additionalProperties": False}]}},
        "required": ["shape"]},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[a-z]{2,4}_[0-9]{1,3}$"}}, "required": ["code"]},
    "format_date_time": {"type": "object", "properties": {
        "at": {"type": "string", "format": "date-time"}}, "required": ["at"]},
    "format_date": {"type": "object", "properties": {
        "on": {"type": "string", "format": "date"}}, "required": ["on"]},
    "format_email": {"type": "object", "properties": {
        "to": {"type": "string", "format": "email", "maxLength": 24}}, "required": ["to"]},
    "format_uuid": {"type": "object", "properties": {
        "id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    "string_lengths": {"type": "object", "properties": {
        "word": {"type": "string", "minLength": 3, "maxLength": 6}}, "required": ["word"]},
    "integer_range": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 65}}, "required": ["age"]},
    "number_exclusive": {"type": "object", "properties": {
        "p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}},
        "required": ["p"]},
    "negative_range": {"type": "object", "properties": {
        "t": {"type": "integer", "minimum": -40, "maximum": -1}}, "required": ["t"]},
    "additional_false": {"type": "object", "properties": {"a": {"type": "boolean"}},
                         "required": ["a"], "additionalProperties": False},
    "additional_schema": {"type": "object", "properties": {},
                          "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    "optional_props": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5},
        "c": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False},
    "all_types": {"type": "object", "properties": {
        "s": {"type": "string", "maxLength": 8}, "i": {"type": "integer"},
        "n": {"type": "number"}, "b": {"type": "boolean"}, "z": {"type": "null"}},
        "required": ["s", "i", "n", "b", "z"], "additionalProperties": False},
    "enum_mixed": {"type": "object", "properties": {"v": {"enum": [1, "two", None, True]}},
                   "required": ["v"]},
    "array_top": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                             "maximum": 9}, "minItems": 1, "maxItems": 5},
    "pydantic_order": {  # what pydantic writes for `Order(items: list[Item], note: str | None)`
        "$defs": {"Item": {"properties": {"name": {"title": "Name", "type": "string",
                                                   "maxLength": 16},
                                          "price": {"title": "Price", "type": "number"}},
                           "required": ["name", "price"], "title": "Item", "type": "object",
                           "additionalProperties": False}},
        "properties": {"items": {"items": {"$ref": "#/$defs/Item"}, "title": "Items",
                                 "type": "array", "maxItems": 3},
                       "note": {"anyOf": [{"type": "string", "maxLength": 16},
                                          {"type": "null"}], "title": "Note"}},
        "required": ["items", "note"], "title": "Order", "type": "object",
        "additionalProperties": False},
    "deep_nesting": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "object", "properties": {
            "d": {"type": "integer"}}, "required": ["d"]}}, "required": ["c"]}},
        "required": ["b"]}}, "required": ["a"]},
    "unbounded_string": {"type": "object", "properties": {"text": {"type": "string"}},
                         "required": ["text"]},
    "unbounded_array": {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "string"}}}, "required": ["xs"]},
}

# Keywords the engine cannot enforce: each is a 400 naming it.
REFUSED: dict[str, dict[str, Any]] = {
    "not": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
    "uniqueItems": {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}},
}
