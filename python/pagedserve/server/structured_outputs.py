"""The request fields that constrain the output (OpenAI's response_format,
vLLM's guided_* and structured_outputs) -> one StructuredOutputsParams, and the
check that it compiles, answered as a 400 naming the field."""

from __future__ import annotations

import asyncio

from starlette.concurrency import run_in_threadpool

from ..errors import InvalidStructuredOutputError
from ..sampling_params import StructuredOutputsParams
from .errors import APIError
from .protocol import _Request

# vLLM's older request fields -> the StructuredOutputsParams field each sets
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _response_format(rf: dict) -> dict | None:
    """OpenAI's response_format as StructuredOutputsParams fields: None for
    text (no constraint), json_object, or json_schema's schema."""
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise APIError(400, f"`response_format.type` must be text, json_object or json_schema, got {kind!r}",
                       param="response_format.type")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise APIError(400, "`response_format.json_schema.schema` must be a JSON schema object",
                       param="response_format.json_schema.schema")
    return {"json": spec["schema"]}


def constraint_of(req: _Request) -> tuple[StructuredOutputsParams, str] | None:
    """The request's output constraint and the field it came from, or None.

    Raises APIError 400 naming the field when a value is malformed, an unknown
    key is given in structured_outputs, or more than one field constrains
    the output.
    """
    found: list[tuple[str, dict]] = []
    if req.response_format and (values := _response_format(req.response_format)) is not None:
        found.append(("response_format", values))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(req, name)
        if value not in (None, [], "", {}):
            found.append((name, {kind: value}))
    if req.structured_outputs is not None:  # {} names no constraint: StructuredOutputsParams refuses it below
        unknown = sorted(set(req.structured_outputs) - set(StructuredOutputsParams.FIELDS))
        if unknown:
            raise APIError(400, f"`structured_outputs.{unknown[0]}` is not supported by this server "
                                f"(supported: {', '.join(StructuredOutputsParams.FIELDS)})",
                           param=f"structured_outputs.{unknown[0]}", code="unsupported_parameter")
        found.append(("structured_outputs", dict(req.structured_outputs)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f"`{name}`" for name, _ in found)
        raise APIError(400, f"give one output constraint, not several ({names})", param=found[1][0])
    field, values = found[0]
    try:
        return StructuredOutputsParams(**values), field
    except ValueError as e:
        raise APIError(400, f"`{field}`: {e}", param=field) from e


async def check_compiles(core, constraint: StructuredOutputsParams, field: str) -> None:
    """Checks the constraint's size and schema keywords here, then compiles it on a
    worker thread (the engine thread then finds it in the compiler's cache);
    raises APIError 400 naming `field` when it is
    invalid, too large or uses a keyword the backend would ignore
    (structured_output/limits.py), does not compile within
    --structured-outputs-compile-timeout seconds (the compile cannot be
    interrupted: it finishes on its thread and is cached), or the server has
    no tokenizer."""
    timeout = core.args.structured_outputs_compile_timeout
    try:
        manager = core.structured_output
        manager.check(constraint)  # refused by what is wrong with it, whatever the timeout
        await asyncio.wait_for(asyncio.shield(run_in_threadpool(manager.compile, constraint)), timeout)
    except asyncio.TimeoutError as e:
        raise APIError(400, f"`{field}`: the constraint did not compile within {timeout:g} s "
                            "(--structured-outputs-compile-timeout); simplify it", param=field,
                       code="constraint_too_complex") from e
    except InvalidStructuredOutputError as e:
        raise APIError(400, f"`{field}`: {e}", param=field) from e
    except ValueError as e:  # no tokenizer
        raise APIError(400, str(e), param=field) from e
