"""What a structured-output constraint may be, checked before it is compiled.

Keywords the grammar backend (xgrammar 0.2) would silently ignore are refused,
because an output that breaks them would still end "stop": each was checked by
compiling a schema that uses it and feeding the grammar a value that violates
it (tests/python/test_structured_output_limits.py repeats that check, so a
backend that starts enforcing one shows up). Refused:

- `not`, `if` / `then` / `else`, `dependentRequired`, `dependentSchemas`,
  `dependencies`, `contains` / `minContains` / `maxContains`, `uniqueItems: true`;
- `allOf` with more than one schema (only the first is applied);
- a `$ref` that is not a local JSON pointer (`#` or `#/...`): remote
  documents, anchors (`#name`); `$dynamicRef`, `$recursiveRef`;
- a `required` name missing from the same schema's `properties`.

`oneOf` is applied as `anyOf` (a value matching two branches is not refused):
documented, not refused, since such unions are common and their branches
rarely overlap.

Sizes (compiling grows with them; a 50,000-entry choice list took 106 s and
500 MiB): at most MAX_CHOICES choices of MAX_CONSTRAINT_BYTES in all, and at
most MAX_CONSTRAINT_BYTES of schema, regex or grammar text.
"""

from __future__ import annotations

import json

from ..errors import InvalidStructuredOutputError
from ..sampling_params import StructuredOutputsParams

MAX_CHOICES = 2048
MAX_CONSTRAINT_BYTES = 256 * 1024  # UTF-8 bytes of the schema, regex, grammar or all choices together

_IGNORED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
            "minContains", "maxContains", "$dynamicRef", "$recursiveRef")
# keywords whose values are data, not schemas: never searched
_DATA = frozenset({"enum", "const", "default", "examples", "description", "title", "$comment"})
# keywords whose values map names to schemas (the names are not keywords)
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


def _refuse(where: str, why: str):
    raise InvalidStructuredOutputError("json", f"invalid JSON schema: {why} at {where or '/'} "
                                               "(the grammar backend would not enforce it)")


def _check(schema, where: str) -> None:
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            _check(item, f"{where}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for key in _IGNORED:
        if key in schema:
            _refuse(where, f"keyword `{key}`")
    if schema.get("uniqueItems") is True:
        _refuse(where, "keyword `uniqueItems`")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        _refuse(where, "keyword `allOf` with more than one schema")
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        _refuse(where, f"keyword `$ref` to {ref!r} (only local references, # or #/..., are resolved)")
    required, props = schema.get("required"), schema.get("properties")
    if isinstance(required, list):
        missing = [name for name in required if not isinstance(props, dict) or name not in props]
        if missing:
            _refuse(where, f"keyword `required` naming {missing[0]!r}, which `properties` does not define")
    for key, value in schema.items():
        if key in _DATA:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _check(sub, f"{where}/{key}/{name}")
        else:
            _check(value, f"{where}/{key}")


def check_schema(schema: dict | bool) -> None:
    """Raises InvalidStructuredOutputError naming the first keyword (and where,
    as a JSON pointer) the grammar backend would ignore."""
    _check(schema, "")


def check_size(params: StructuredOutputsParams) -> None:
    """Raises InvalidStructuredOutputError when the constraint is larger than
    MAX_CHOICES choices or MAX_CONSTRAINT_BYTES of text."""
    kind = params.kind
    if kind == "choice":
        if len(params.choice) > MAX_CHOICES:
            raise InvalidStructuredOutputError(kind, f"too many choices: {len(params.choice)} (at most {MAX_CHOICES})")
        size = sum(len(c.encode()) for c in params.choice)
    elif kind == "json":
        size = len((params.json if isinstance(params.json, str) else json.dumps(params.json)).encode())
    elif kind in ("regex", "grammar"):
        size = len(getattr(params, kind).encode())
    else:
        return
    if size > MAX_CONSTRAINT_BYTES:
        raise InvalidStructuredOutputError(kind, f"the {kind} is {size} bytes; at most {MAX_CONSTRAINT_BYTES} "
                                                 "are compiled")
