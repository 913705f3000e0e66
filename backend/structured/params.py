"""What a request asks its output to follow: the request format, checked here, without XGrammar.

A request constrains its output with one of three keys of its sampling parameters:

- `guided_decoding` (vLLM's `GuidedDecodingParams`, what Triton's vLLM backend took until 25.11) or
  `structured_outputs` (vLLM's newer name for the same, what Triton's OpenAI frontend sends since 25.11 for a
  named or `required` tool choice), each an object or a JSON string of one (the frontend double-encodes it), with
  exactly one of:
      json          a JSON schema (an object, or a string of one)
      json_object   true: any JSON object
      regex         a regular expression the whole output matches
      choice        a non-empty list of strings: the output is one of them
      grammar       an EBNF grammar (XGrammar's dialect, GBNF-like; the root rule is `root`)
      structural_tag  an XGrammar structural tag (an object, or a string of one, as vLLM takes it): its current
                    form {"type": "structural_tag", "format": {...}}, or the older {"structures": [{"begin", "schema",
                    "end"}, ...], "triggers": [...]} (free text, each structure's schema enforced between its begin
                    and end once a trigger starts it); what a `tool_choice` of "required" or a named function
                    becomes too (backend/tool_choice.py)
  and optionally `disable_any_whitespace` (JSON without free whitespace: `{"a": 1, "b": [1, 2]}`) and
  `disable_additional_properties` (every object of the schema closed: `additionalProperties: false`; without it
  XGrammar's strict mode already generates no property the schema does not name, unless the schema allows them
  itself). A schema's properties are generated in the order it lists them. vLLM's other fields are accepted when
  they ask nothing this engine does not do: `backend` / `_backend` (None, "auto" or "xgrammar"),
  `disable_fallback` (there is nothing to fall back to), `_backend_was_auto`, and `whitespace_pattern` only when
  null.
- `response_format`, OpenAI's: {"type": "text"} (no constraint, so it may come beside another key),
  {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, ...}}.

A malformed value raises ValueError naming what is wrong; the grammar itself (schema, regex, EBNF) is checked
when it is parsed at admission (backend/structured/grammar.py), before the request is queued.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backend.errors import is_int, json_depth, load_json

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
GUIDED_KEYS = ("guided_decoding", "structured_outputs", "response_format")
_BACKENDS = (None, "", "auto", "xgrammar")
_BACKEND_KEYS = ("backend", "_backend")
_FLAGS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback", "_backend_was_auto",
          "backend_was_auto")
_UNSUPPORTED_UNLESS_NULL = ("whitespace_pattern",)
_JSON_FLAGS = ("disable_any_whitespace", "disable_additional_properties")  # (a `json` constraint's)


@dataclass(frozen=True)
class GuidedDecoding:
    """One request's output constraint. `spec` is its text (a schema serialised compactly, its keys in the order
    given: properties are generated in that order; the choices as a JSON list), so that equal constraints share one
    compiled grammar (`key`)."""

    kind: str  # one of KINDS
    spec: str
    any_whitespace: bool = True

    @property
    def key(self) -> tuple[str, str, bool]:
        return self.kind, self.spec, self.any_whitespace

    @property
    def choices(self) -> list[str]:
        return json.loads(self.spec)


# XGrammar's parse of a JSON schema (on the thread that takes requests) grows faster than its nesting squared: 400
# levels of arrays took 4 s, 900 took 46 s. A schema nests far less than this.
MAX_SCHEMA_DEPTH = 64


def guided_decoding_from_sampling(params: Mapping[str, Any], where: str) -> GuidedDecoding | None:
    """The constraint among a request's sampling parameters (the keys GUIDED_KEYS), None when it has none."""
    given = [key for key in GUIDED_KEYS if params.get(key) is not None and not _is_text_format(key, params[key])]
    if len(given) > 1:
        raise ValueError(f"{where} gives {given}: send one output constraint")
    if not given:
        return None
    key = given[0]
    value = _json_value(params[key], f"{key} in {where}")
    if key == "response_format":
        return _from_response_format(value)
    return _from_guided(value, key)


def _is_text_format(key: str, value: Any) -> bool:
    """response_format {"type": "text"} (or its JSON string): no constraint (so it may come beside one)."""
    if key != "response_format":
        return False
    if isinstance(value, str):
        try:
            value = load_json(value, key)
        except ValueError:
            return False  # (reported when it is read as the constraint)
    return isinstance(value, dict) and value.get("type") == "text"


def _json_value(value: Any, where: str) -> Any:
    """An object, or a JSON string of one (Triton's OpenAI frontend and vLLM backend send strings)."""
    if isinstance(value, str):
        value = load_json(value, where)
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _from_guided(value: dict, where: str) -> GuidedDecoding:
    known = set(KINDS) | {*_FLAGS, *_BACKEND_KEYS, *_UNSUPPORTED_UNLESS_NULL}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {where}; known: {sorted(known)}")
    for name in _UNSUPPORTED_UNLESS_NULL:
        if value.get(name) is not None:
            raise ValueError(f"{where}: {name} is not supported (use disable_any_whitespace for compact JSON)")
    for name in _BACKEND_KEYS:
        if value.get(name) not in _BACKENDS:
            raise ValueError(f"{where}: {name} must be 'xgrammar' or 'auto' (XGrammar is the one here), "
                             f"got {value[name]!r}")
    for flag in _FLAGS:
        if value.get(flag) is not None and not isinstance(value[flag], bool):
            raise ValueError(f"{where}: {flag} must be a boolean, got {value[flag]!r}")
    kinds = [kind for kind in KINDS if value.get(kind) is not None and value.get(kind) is not False]
    if len(kinds) != 1:
        raise ValueError(f"{where} must give exactly one of {list(KINDS)}, got "
                         f"{kinds if kinds else 'none'}")
    kind = kinds[0]
    spec = value[kind]
    if kind == "structural_tag" and (flags := [f for f in _JSON_FLAGS if value.get(f)]):
        raise ValueError(f"{where}: {flags} shape JSON schemas, not a structural tag: give the tag's own formats")
    if kind == "json" and value.get("disable_additional_properties"):
        spec = _without_additional_properties(_spec(kind, spec, where))
    return GuidedDecoding(kind, _spec(kind, spec, where), any_whitespace=not value.get("disable_any_whitespace"))


def _without_additional_properties(schema_text: str) -> dict:
    """The schema with `additionalProperties: false` on every object schema in it (vLLM's
    disable_additional_properties); values (`const`, `enum`, `default`) and property names are left as they are."""
    def close(node):
        if not isinstance(node, dict):  # (a boolean schema)
            return node
        node = _map_subschemas(node, close)
        if node.get("type") == "object" or isinstance(node.get("properties"), dict):
            node["additionalProperties"] = False
        return node

    return close(json.loads(schema_text))


# A schema's keywords whose values are schemas: maps of them, lists of them, or one (`items` may be a list, as in
# draft 4). The other keywords hold values (`const`, `enum`, `default`, `examples`) or numbers and names.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedItems", "unevaluatedProperties", "not",
               "if", "then", "else", "contains", "propertyNames")


def _map_subschemas(node: dict, fn) -> dict:
    """A copy of the schema `node` with `fn` applied to each of its subschemas."""
    node = dict(node)
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {name: fn(schema) for name, schema in node[key].items()}
    for key in (*_SCHEMA_LISTS, *_SCHEMA_ONE):
        if key in node:
            node[key] = [fn(schema) for schema in node[key]] if isinstance(node[key], list) else fn(node[key])
    return node


# Keywords XGrammar (0.2.8, 0.2.9) drops without a word, so that an output could break them and still end with "stop"
# (compiled with and without each, the grammar is the same; 0.2.9 takes minContains as a minItems, no more); vLLM
# refuses schemas with such features for XGrammar too. allOf of more than one schema is compiled as any JSON value.
_NOT_ENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "propertyNames",
                 "unevaluatedProperties", "uniqueItems", "contains", "minContains", "maxContains")


def _dropped_by_xgrammar(node: dict) -> str | None:
    """What XGrammar (0.2.9) leaves out of one schema node's grammar beside the keywords of _NOT_ENFORCED (an output
    breaking it ends with "stop"): a multipleOf but an integer's of an integer (0.5 of a number took 0.3, 2.5 of
    an integer took 3), the length bounds of a
    string with a pattern (the pattern alone is compiled), an empty anyOf / oneOf (it compiled to the empty text)."""
    types = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
    if "multipleOf" in node and not ("integer" in types and "number" not in types and is_int(node["multipleOf"])):
        return "multipleOf (but an integer one of an integer)"
    if "pattern" in node and ("minLength" in node or "maxLength" in node):
        return "minLength / maxLength beside a pattern (put the length in the pattern)"
    empty = [key for key in ("anyOf", "oneOf") if node.get(key) == []]
    return f"an empty {empty[0]} (nothing can match it)" if empty else None


def _check_enforceable(schema: Any, where: str) -> None:
    """ValueError naming the first keyword of the schema (in schema positions) that its grammar would not enforce."""
    def visit(node):
        if isinstance(node, dict):
            found = [key for key in _NOT_ENFORCED if key in node and node[key] is not False]
            if found:
                raise ValueError(f"{where}: the JSON schema keyword(s) {found} cannot be enforced here (XGrammar "
                                 f"ignores them); remove them or check the output yourself")
            if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
                raise ValueError(f"{where}: allOf of more than one schema cannot be enforced here (XGrammar takes "
                                 f"it as any value); merge them into one schema")
            if problem := _dropped_by_xgrammar(node):
                raise ValueError(f"{where}: {problem} cannot be enforced here (XGrammar ignores it); change the "
                                 f"schema or check the output yourself")
            _map_subschemas(node, visit)
        return node

    visit(schema)


def _check_tag_schemas(tag: dict, where: str) -> None:
    """A structural tag's JSON schemas checked as a `json` constraint's are (nesting, keywords XGrammar would not
    enforce): a format's `json_schema`, an older form's structures' `schema`; and the tag itself no deeper than two
    schemas."""
    if (depth := json_depth(tag)) > 2 * MAX_SCHEMA_DEPTH:
        raise ValueError(f"{where} nests {depth} levels deep, more than {2 * MAX_SCHEMA_DEPTH}")
    structures = tag.get("structures")
    schemas = [s.get("schema") for s in structures if isinstance(s, dict)] if isinstance(structures, list) else []
    level = [tag.get("format")]
    while level:  # (down the formats, not into the schemas they hold: a schema's values are not formats)
        schemas += [node["json_schema"] for node in level if isinstance(node, dict) and "json_schema" in node]
        level = [child for node in level if isinstance(node, (dict, list))
                 for key, child in (node.items() if isinstance(node, dict) else enumerate(node))
                 if key != "json_schema"]
    for schema in schemas:
        if isinstance(schema, (dict, str)):
            checked_json_schema(schema, where)


def checked_json_schema(schema: Any, where: str) -> str:
    """A JSON schema (an object, or a string of one) checked as a `json` constraint's is; its compact text."""
    return _spec("json", schema, where)


def _spec(kind: str, value: Any, where: str) -> str:
    if kind == "json":
        if isinstance(value, str):
            value = load_json(value, f"{where}: the json schema text")
        if not isinstance(value, (dict, bool)):
            raise ValueError(f"{where}: json must be a JSON schema (an object), got {type(value).__name__}")
        if (depth := json_depth(value)) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{where}: the JSON schema's JSON nests {depth} levels deep, more than {MAX_SCHEMA_DEPTH}")
        _check_enforceable(value, where)
        return json.dumps(value, separators=(",", ":"))  # (key order kept: it is the output's property order)
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"{where}: json_object must be true, got {value!r}")
        return ""
    if kind == "structural_tag":
        if isinstance(value, str):
            value = load_json(value, f"{where}: the structural_tag text")
        if not isinstance(value, dict) or not ("format" in value or "structures" in value):
            raise ValueError(f"{where}: structural_tag must be an object with `format` (XGrammar's structural tag) or "
                             f"`structures` and `triggers` (its older form), got {value!r:.200}")
        _check_tag_schemas(value, f"{where}: structural_tag")
        return json.dumps(value, separators=(",", ":"))
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise ValueError(f"{where}: choice must be a non-empty list of strings, got {value!r}")
        if not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"{where}: every choice must be a non-empty string, got {value!r}")
        return json.dumps(value)
    if not isinstance(value, str) or not value:  # regex, grammar
        raise ValueError(f"{where}: {kind} must be a non-empty string, got {value!r}")
    return value


def _from_response_format(value: dict) -> GuidedDecoding | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding("json_object", "")
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, dict) or body.get("schema") is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema (the JSON schema)")
        return GuidedDecoding("json", _spec("json", body["schema"], "response_format.json_schema"))
    raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
