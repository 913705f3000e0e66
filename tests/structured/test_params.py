"""The output-constraint request format (backend/structured/params.py): vLLM's guided_decoding /
structured_outputs as objects and as the JSON strings Triton's OpenAI frontend and vLLM backend send, OpenAI's
response_format, and a clear error for each malformed form."""

from __future__ import annotations

import json

import pytest

from backend.request import SamplingParams
from backend.structured.params import GuidedDecoding

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# XGrammar's structural tag, as vLLM's guided_decoding takes it: text, then a JSON object between two tags
STRUCTURAL_TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "Answer: "},
    {"type": "tag", "begin": "<json>", "content": {"type": "json_schema", "json_schema": {"type": "object"}},
     "end": "</json>"}]}}


def _guided(params: dict) -> GuidedDecoding | None:
    return SamplingParams.from_dict(params).guided_decoding


@pytest.mark.parametrize("key", ["guided_decoding", "structured_outputs"])
def test_each_kind_as_an_object_and_as_a_json_string(key):
    cases = {"json": SCHEMA, "regex": "[a-z]+", "choice": ["yes", "no"], "grammar": 'root ::= "a"', "json_object": True,
             "structural_tag": STRUCTURAL_TAG}
    for kind, value in cases.items():
        as_object = _guided({key: {kind: value}})
        as_string = _guided({key: json.dumps({kind: value})})
        assert as_object == as_string and as_object.kind == kind


def test_a_structural_tags_schemas_are_checked_not_the_values_in_them():
    """A `json_schema` key inside a schema's `enum`, `const` or `default` is a value, not a format's schema."""
    schema = {"type": "object", "properties": {"a": {"enum": [{"json_schema": "x"}]}},
              "default": {"json_schema": {"not": {}}}}
    tag = {"format": {"type": "json_schema", "json_schema": schema}}
    assert _guided({"guided_decoding": {"structural_tag": tag}}).kind == "structural_tag"


def test_the_openai_frontends_double_encoded_structured_outputs():
    """What Triton's OpenAI frontend sends for a named tool choice (vLLM path, 25.11 on): the schema as a string
    inside asdict(StructuredOutputsParams(json=...)) as a string inside sampling_parameters."""
    params = {"json": json.dumps(SCHEMA), "regex": None, "choice": None, "grammar": None, "json_object": None,
              "disable_any_whitespace": False, "disable_additional_properties": False, "whitespace_pattern": None,
              "structural_tag": None, "_backend": None, "_backend_was_auto": False}
    sampling = json.loads(json.dumps({"temperature": 0, "max_tokens": 16, "structured_outputs": json.dumps(params)}))
    guided = SamplingParams.from_dict(sampling).guided_decoding
    assert guided == GuidedDecoding("json", json.dumps(SCHEMA, separators=(",", ":")))


def test_equal_schemas_share_a_key_whatever_their_form_but_property_order_counts():
    """The order of a schema's properties is the order they are generated in (a reasoning field before the answer):
    it is kept, and so a reordered schema is another constraint."""
    spaced = json.dumps(SCHEMA, indent=4)
    assert _guided({"guided_decoding": {"json": SCHEMA}}).key == _guided({"guided_decoding": {"json": spaced}}).key
    two = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}}}
    swapped = {"type": "object", "properties": {"answer": {"type": "integer"}, "reasoning": {"type": "string"}}}
    first, second = (_guided({"guided_decoding": {"json": s}}) for s in (two, swapped))
    assert first.key != second.key and list(json.loads(first.spec)["properties"]) == ["reasoning", "answer"]
    compact = _guided({"guided_decoding": {"json": SCHEMA, "disable_any_whitespace": True}})
    assert compact.key != _guided({"guided_decoding": {"json": SCHEMA}}).key and not compact.any_whitespace


def test_disable_additional_properties_closes_every_object_of_the_schema():
    open_schema = {"type": "object", "properties": {"inner": {"type": "object", "additionalProperties": True},
                                                    "items": {"type": "array", "items": {"properties": {}}}}}
    closed = json.loads(_guided({"guided_decoding": {"json": open_schema,
                                                     "disable_additional_properties": True}}).spec)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["properties"]["items"]["items"]["additionalProperties"] is False
    assert _guided({"guided_decoding": {"json": open_schema}}).spec == json.dumps(open_schema, separators=(",", ":"))


def test_disable_additional_properties_leaves_values_and_property_names_alone():
    """Only schemas are closed: a `const` value shaped like a schema, and a property named "properties", are not."""
    schema = {"type": "object", "properties": {"c": {"const": {"type": "object"}},
                                               "properties": {"type": "integer"}}, "required": ["c"]}
    closed = json.loads(_guided({"guided_decoding": {"json": schema, "disable_additional_properties": True}}).spec)
    assert closed["properties"]["c"] == {"const": {"type": "object"}}
    assert closed["properties"]["properties"] == {"type": "integer"} and closed["additionalProperties"] is False


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"const": 5}}, "contains"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"$defs": {"x": {"if": {"type": "string"}, "then": {"minLength": 2}}}, "$ref": "#/$defs/x"}, "if"),
    ({"allOf": [{"type": "integer", "minimum": 5}, {"maximum": 6}]}, "allOf of more than one schema"),
    ({"type": "object", "properties": {"price": {"type": "number", "multipleOf": 0.01}}}, "multipleOf"),
    ({"type": "integer", "multipleOf": 2.5}, "multipleOf"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "maxLength beside a pattern"),
    ({"type": "object", "properties": {"a": {"anyOf": []}}}, "an empty anyOf"),
])
def test_schema_keywords_the_grammar_would_not_enforce_are_refused(schema, keyword):
    """XGrammar drops these without a word: an output could break them and still end with "stop"."""
    with pytest.raises(ValueError, match=keyword):
        _guided({"guided_decoding": {"json": schema}})
    # (in a value, not a schema, they are only data)
    assert _guided({"guided_decoding": {"json": {"const": schema}}}).kind == "json"


def test_what_xgrammar_does_enforce_of_those_is_taken():
    """An integer's multipleOf and a pattern's string without length bounds compile to grammars that hold them."""
    for schema in ({"type": "integer", "multipleOf": 3}, {"type": ["integer", "null"], "multipleOf": 5},
                   {"type": "string", "pattern": "^a{1,2}$"},
                   {"anyOf": [{"type": "integer"}]}):
        assert _guided({"guided_decoding": {"json": schema}}).kind == "json"


@pytest.mark.parametrize("text", [{"type": "text"}, '{"type": "text"}'])
def test_a_text_response_format_beside_a_constraint_is_no_second_constraint(text):
    guided = _guided({"response_format": text, "guided_decoding": {"regex": "a+"}})
    assert guided.kind == "regex"


def test_response_format():
    assert _guided({"response_format": {"type": "text"}}) is None
    assert _guided({"response_format": {"type": "json_object"}}).kind == "json_object"
    schema = _guided({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                                  "strict": True}}})
    assert schema == _guided({"guided_decoding": {"json": SCHEMA}})


def test_no_constraint_is_none():
    assert SamplingParams.from_dict({"max_tokens": 4}).guided_decoding is None
    assert _guided({"guided_decoding": None}) is None


@pytest.mark.parametrize("params,message", [
    ({"guided_decoding": {"json": SCHEMA, "regex": "a"}}, "exactly one of"),
    ({"guided_decoding": {}}, "exactly one of"),
    ({"guided_decoding": {"choice": []}}, "non-empty list"),
    ({"guided_decoding": {"choice": ["a", ""]}}, "non-empty string"),
    ({"guided_decoding": {"choice": "a"}}, "non-empty list"),
    ({"guided_decoding": {"regex": ""}}, "non-empty string"),
    ({"guided_decoding": {"json": "{not json"}}, "json schema text is not valid JSON"),
    ({"guided_decoding": {"json": [1]}}, "must be a JSON schema"),
    ({"guided_decoding": {"json_object": "yes"}}, "json_object must be true"),
    ({"guided_decoding": "{oops"}, "not valid JSON"),
    ({"guided_decoding": [1]}, "must be a JSON object"),
    ({"guided_decoding": {"regex": "a", "whitespace_pattern": " *"}}, "whitespace_pattern is not supported"),
    ({"guided_decoding": {"regex": "a", "structural_tag": STRUCTURAL_TAG}}, "exactly one of"),
    ({"guided_decoding": {"structural_tag": "{}"}}, "structural_tag must be an object with `format`"),
    ({"guided_decoding": {"structural_tag": ["a"]}}, "structural_tag must be an object with `format`"),
    ({"guided_decoding": {"structural_tag": {"format": {"type": "json_schema", "json_schema": {"not": {}}}}}},
     r"structural_tag: the JSON schema keyword\(s\) \['not'\] cannot be enforced"),
    ({"guided_decoding": {"structural_tag": {"structures": [{"begin": "<a>", "schema": {"uniqueItems": True},
                                                             "end": "</a>"}], "triggers": ["<a"]}}},
     r"\['uniqueItems'\] cannot be enforced"),
    ({"guided_decoding": {"structural_tag": {"format": {"type": "json_schema", "json_schema": json.loads(
        '{"type": "array", "items": ' * 65 + '{"type": "string"}' + "}" * 65)}}}},
     "nests 66 levels deep, more than 64"),
    ({"guided_decoding": {"structural_tag": {"structures": None, "format": {"type": "json_schema", "json_schema": {
        "uniqueItems": True}}}}}, r"\['uniqueItems'\] cannot be enforced"),
    ({"guided_decoding": {"structural_tag": STRUCTURAL_TAG, "disable_any_whitespace": True}},
     r"\['disable_any_whitespace'\] shape JSON schemas, not a structural tag"),
    ({"guided_decoding": {"regex": "a", "backend": "outlines"}}, "backend must be"),
    ({"guided_decoding": {"regex": "a", "disable_any_whitespace": "no"}}, "must be a boolean"),
    ({"guided_decoding": {"regex": "a", "disable_fallback": 1}}, "disable_fallback must be a boolean"),
    ({"guided_decoding": {"regex": "a", "colour": 1}}, "unknown key"),
    ({"guided_decoding": {"regex": "a"}, "structured_outputs": {"regex": "b"}}, "send one output constraint"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    # (XGrammar's parse of so deep a schema, on the thread that takes requests, would take seconds to minutes)
    ({"guided_decoding": {"json": '{"type": "array", "items": ' * 65 + '{"type": "string"}' + "}" * 65}},
     "nests 66 levels deep, more than 64"),
    ({"guided_decoding": {"json": "[" * 100_000 + "]" * 100_000}}, "nests too deeply"),
    ({"guided_decoding": '{"json": ' + "[" * 100_000 + "]" * 100_000 + "}"}, "nests too deeply"),
    ({"response_format": "[" * 100_000 + "]" * 100_000}, "nests too deeply"),
])
def test_malformed_constraints_are_refused_with_a_message_naming_the_problem(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(params)
