"""Issue 30 part 7: structured-output limits. Every keyword limits.py refuses
is still ignored by the grammar backend (a violating value is accepted: if the
backend starts enforcing one, this fails and the refusal can go); schemas using
them, too many choices, too large a constraint and a compile past the time
bound are 400s naming the field, and the server keeps serving."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from pagedserve.errors import InvalidStructuredOutputError
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured_output.limits import MAX_CHOICES, MAX_CONSTRAINT_BYTES, check_schema, check_size

INT = {"type": "integer"}
OBJ_AB = {"type": "object", "properties": {"a": INT, "b": INT}}
# keyword -> (a schema using it, a value that breaks it, a value that keeps it)
IGNORED = {
    "not": ({"type": "object", "properties": {"a": {"not": INT}}, "required": ["a"]}, '{"a": 1}', '{"a": "x"}'),
    "uniqueItems": ({"type": "array", "items": INT, "uniqueItems": True}, "[1, 1]", "[1, 2]"),
    "if": ({**OBJ_AB, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, '{"a": 1}',
           '{"a": 1, "b": 2}'),
    "dependentRequired": ({**OBJ_AB, "dependentRequired": {"a": ["b"]}}, '{"a": 1}', '{"a": 1, "b": 2}'),
    "dependentSchemas": ({**OBJ_AB, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}',
                         '{"a": 1, "b": 2}'),
    "contains": ({"type": "array", "items": INT, "contains": {"const": 5}}, "[1]", "[5]"),
    "allOf": ({"allOf": [INT, {"minimum": 5}]}, "3", "6"),
    "$ref": ({"$defs": {"x": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}, '"s"', "1"),
    "required": ({"type": "object", "properties": {"a": INT}, "required": ["a", "b"]}, '{"a": 1}', None),
}


@pytest.mark.parametrize("keyword", list(IGNORED))
def test_each_refused_keyword_is_one_the_backend_ignores(keyword):
    schema, bad, good = IGNORED[keyword]
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert accepts(grammar, bad), f"the backend now enforces {keyword}: stop refusing it"
    assert good is None or accepts(grammar, good)
    with pytest.raises(InvalidStructuredOutputError, match=re.escape(f"`{keyword}")):
        check_schema(schema)


def test_schemas_the_backend_enforces_pass_and_names_are_not_keywords():
    for schema in [{"type": "object", "properties": {"not": INT, "if": INT}, "required": ["not"]},
                   {"allOf": [{"$ref": "#/$defs/x"}], "$defs": {"x": INT}},
                   {"type": "array", "items": INT, "uniqueItems": False},
                   {"enum": [{"not": 1}]}, {"anyOf": [INT, {"type": "null"}]}]:
        check_schema(schema)
    with pytest.raises(InvalidStructuredOutputError, match="/properties/a/items"):
        check_schema({"type": "object", "properties": {"a": {"type": "array", "items": {"not": INT}}}})


def test_sizes():
    check_size(StructuredOutputsParams(choice=[str(i) for i in range(MAX_CHOICES)]))
    with pytest.raises(InvalidStructuredOutputError, match="too many choices"):
        check_size(StructuredOutputsParams(choice=[str(i) for i in range(MAX_CHOICES + 1)]))
    with pytest.raises(InvalidStructuredOutputError, match="bytes"):
        check_size(StructuredOutputsParams(regex="a" * (MAX_CONSTRAINT_BYTES + 1)))


def test_the_server_refuses_by_field_and_keeps_serving(tiny_chat_dir_limits):
    from serverlib import start_server, stop_server

    proc, base = start_server("--model", tiny_chat_dir_limits, "--dtype", "float32", "--max-model-len", "256",
                              "--structured-outputs-compile-timeout", "0.001", "--log-level", "warning")
    try:
        body = {"prompt": "hi", "max_tokens": 4}

        def post(extra):
            return httpx.post(base + "/v1/completions", json={**body, **extra}, timeout=60)

        schema = IGNORED["not"][0]
        r = post({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format" and "`not`" in r.text
        r = post({"guided_choice": [str(i) for i in range(MAX_CHOICES + 1)]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_choice" and "too many" in r.text
        # 0.001 s: a fresh grammar of some size does not compile in time
        grammar = "root ::= " + " | ".join(f'"word{i} "' for i in range(1500))
        r = post({"guided_grammar": grammar})
        assert r.status_code == 400 and r.json()["error"]["code"] == "constraint_too_complex", r.text
        assert post({}).status_code == 200  # still serving
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def tiny_chat_dir_limits(smollm2_dir, tmp_path_factory):
    from conftest import make_tiny_chat_model

    return make_tiny_chat_model(smollm2_dir, tmp_path_factory.mktemp("tiny_limits"), 256)
