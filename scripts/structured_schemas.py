"""JSON schemas for structured outputs, shared by the tests (tests/structured) and scripts/bench_structured.py.

Nesting, enums, arrays with bounds, integers and numbers with ranges, required and optional fields, string
patterns and lengths, $defs references, anyOf, const, nullable fields and additionalProperties. Every string and
array is bounded, so that even a greedy random model (the built-in checkpoint), which nothing but the mask keeps on
track, reaches the end of the document well within a few hundred tokens.
"""

from __future__ import annotations

SHORT = {"type": "string", "maxLength": 12}

SCHEMAS: dict[str, dict] = {
    "person": {"type": "object", "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0,
                                                                       "maximum": 130}},
               "required": ["name", "age"]},
    "optional_fields": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                         "nickname": SHORT, "email": SHORT},
                        "required": ["id"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"enum": ["S", "M", "L", "XL"]}},
             "required": ["color", "size"]},
    "bounded_array": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                                "minItems": 1, "maxItems": 4}},
                      "required": ["tags"]},
    "array_of_integers": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
                          "minItems": 2, "maxItems": 5},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": SHORT, "address": {
            "type": "object", "properties": {"city": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]}}, "required": ["name", "address"]}},
        "required": ["user"]},
    "number_range": {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -40,
                                                                      "maximum": 60}},
                     "required": ["temperature"]},
    "boolean_and_null": {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
                         "required": ["ok", "note"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"]},
    "string_lengths": {"type": "object", "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 5}},
                       "required": ["word"]},
    "const": {"type": "object", "properties": {"version": {"const": "v4"}, "n": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9}},
              "required": ["version", "n"]},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                                    SHORT]}},
               "required": ["value"]},
    "nullable": {"type": "object", "properties": {"parent": {"type": ["string", "null"], "maxLength": 8}},
                 "required": ["parent"]},
    "defs_ref": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"]}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"]},
    "array_of_objects": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1,
                                                                          "maximum": 9}},
        "required": ["sku", "qty"]}, "minItems": 1, "maxItems": 3},
    "tool_call": {"type": "object", "properties": {
        "name": {"enum": ["get_weather", "search"]},
        "arguments": {"type": "object", "properties": {"city": SHORT, "unit": {"enum": ["c", "f"]}},
                      "required": ["city"]}},
        "required": ["name", "arguments"]},
    "no_additional_properties": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9}},
                                 "required": ["a"], "additionalProperties": False},
    "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2},
    "date_like": {"type": "object", "properties": {"date": {"type": "string",
                                                            "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
                  "required": ["date"]},
    "deep_nesting": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "object", "properties": {"d": {"type": "boolean"}},
                                               "required": ["d"]}}, "required": ["c"]}}, "required": ["b"]}},
        "required": ["a"]},
    "integer_enum_mix": {"type": "object", "properties": {"level": {"enum": [1, 2, 3]},
                                                          "mode": {"enum": ["fast", "slow"]},
                                                          "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
                         "required": ["level", "mode"]},
}

# A document whose only field cannot close before max_tokens: constrained requests of a benchmark run as long as
# unconstrained ones (scripts/bench_structured.py), so their decode tokens per second compare like for like.
LONG_TEXT = {"type": "object", "properties": {"text": {"type": "string", "minLength": 100000}}, "required": ["text"]}
