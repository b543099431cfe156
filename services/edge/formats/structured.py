"""Structured outputs: what each API calls a constraint (Chat `response_format`, Responses `text.format`,
TGI `parameters.grammar`) turned into one engine-neutral `bus.Constraint`, which vLLM's structured-output
decoding then guarantees token by token. A schema or regex that cannot be used is refused here, naming the
field, before anything is queued; the engine's own compile errors come back as a 400 too.

Only the sizes are checked here, on the loop; the checks that cost by the byte (a schema's shape and
meta-schema, a pattern's compile) are services.edge.schema_checks', which a planner runs off the loop."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
import orjson

from services.edge import schema_checks
from services.edge.formats.base import Request
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest

SchemaName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
MAX_SPEC_BYTES = 64 * 1024
MAX_SCHEMA_ITEMS = 10_000
"""Array items a constraint may ask for, all told: the sum of its schemas' `minItems`, `maxItems`, `minContains`
and `maxContains`. Where vLLM's XGrammar backend cannot take a schema (an array with a minimum and no `items`,
say), vLLM falls back to llguidance, which spells every counted item out on the worker's
event loop while it checks the request (and again in the engine when it compiles it): `maxItems` 10^5 took 0.2 s
there, 10^6 2.4 s and 1 GiB, 10^7 over a minute and 12 GiB; one `minItems` of 10^8 held the loop 18 s (10 GiB):
every stream of that worker stalled, its heartbeats stopped and the edges took it for dead (new requests a 404,
no live worker; the request itself a 503, worker_lost). The cost adds up over a schema (nested
arrays and alternatives are rules that refer to each other, not copies): 10^4 items all told cost it ~14 ms."""
_ITEM_COUNTS = re.compile(rb'"(?:minItems|maxItems|minContains|maxContains)":(\d+(?:\.\d+)?(?:[eE]\+?\d+)?)')


class JsonSchemaSpec(Request):
    """OpenAI's `json_schema` format: a named schema (Chat nests it, Responses flattens it)."""

    name: SchemaName
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TagStructure(Request):
    """One tag of XGrammar's structural-tag format as OVMS and vLLM take it: text between `begin` and `end`
    that follows a JSON schema."""

    begin: Annotated[str, msgspec.Meta(min_length=1)]
    end: str
    schema: Any = None


class ResponseFormat(Request):
    """Chat Completions `response_format` (also OVMS's on Responses): `structural_tag` is XGrammar's format,
    either `structures` with `triggers` (each structure's text is held to its schema once the model writes
    a trigger) or a `format` object in XGrammar's own terms."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaSpec | None = None
    structures: list[TagStructure] | None = None
    triggers: list[Annotated[str, msgspec.Meta(min_length=1)]] | None = None
    format: dict[str, Any] | None = None


class StructuredOutputs(Request):
    """vLLM's `structured_outputs` extension (Chat, Completions, Responses): one of a JSON schema, a regular
    expression, a choice between strings, or any JSON object."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None
    structural_tag: Any = None


class Grammar(Request):
    """TGI's `parameters.grammar`: a JSON schema (as an object or its text), one named (`json_schema`: its
    `schema`), or a regular expression."""

    type: Literal["json", "json_schema", "regex"]
    value: Any


def checked_schema(schema: Any, param: str) -> dict[str, Any]:
    """A JSON schema (an object, or its text) within our bounds, checked against the JSON Schema meta-schema.

    The bounds come first, on the size alone: the meta-schema check and the engine's grammar compile grow
    with the schema, and a request must not buy seconds of either. Beyond the first few KiB of a request's
    schemas, the checks are made later, off the loop, where a planner collects them (schema_checks.defer):
    the schema returned is then not yet known to be one."""
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_BYTES:
            raise InvalidRequest(f"`{param}` is larger than {MAX_SPEC_BYTES} bytes.", param=param)
        try:
            schema = orjson.loads(schema)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"`{param}` is not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"`{param}` must be a JSON schema object.", param=param)
    encoded = json_bytes(schema, param)
    if len(encoded) > MAX_SPEC_BYTES:
        raise InvalidRequest(f"`{param}` is larger than {MAX_SPEC_BYTES} bytes.", param=param)
    check_items(encoded, param)
    if not schema_checks.defer("schema", param, encoded):
        schema_checks.check_schema(schema, param)
    return schema


def json_bytes(value: Any, param: str) -> bytes:
    """A request's object as JSON again, or a 400 naming `param` where JSON cannot carry it on: nested beyond
    orjson's 254 levels, or holding an integer beyond 64 bits (both decode, and were 500s where written out)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        raise InvalidRequest(f"`{param}` cannot be used (nested too deeply, or an integer beyond 64 bits).",
                             param=param) from None


def check_items(encoded: bytes, param: str) -> None:
    """Refuses a constraint (its JSON) that asks for more than MAX_SCHEMA_ITEMS array items all told. Read from
    the JSON's bytes in one scan, on the loop: a key of that name in a `const` or `enum` value counts too."""
    asked = sum(float(count) for count in _ITEM_COUNTS.findall(encoded))
    if asked > MAX_SCHEMA_ITEMS:
        raise InvalidRequest(f"`{param}` counts {asked:.0f} array items in its minItems, maxItems, minContains and "
                             f"maxContains, all told; at most {MAX_SCHEMA_ITEMS} are served.", param=param)


def json_schema(schema: Any, param: str) -> bus.Constraint:
    """A constraint to a JSON schema, checked against the JSON Schema meta-schema first."""
    return bus.Constraint(kind="json", spec=orjson.dumps(checked_schema(schema, param)).decode())


def regex(pattern: Any, param: str) -> bus.Constraint:
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequest(f"`{param}` must be a non-empty regular expression.", param=param)
    if len(pattern) > MAX_SPEC_BYTES:
        raise InvalidRequest(f"`{param}` is longer than {MAX_SPEC_BYTES} characters.", param=param)
    if not schema_checks.defer("regex", param, orjson.dumps(pattern)):  # 5 characters may take 9 ms to compile
        schema_checks.check_regex(pattern, param)
    return bus.Constraint(kind="regex", spec=pattern)


JSON_OBJECT = bus.Constraint(kind="json_object")


def of_response_format(fmt: ResponseFormat | None) -> bus.Constraint | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JSON_OBJECT
    if fmt.type == "structural_tag":
        return structural_tag(fmt)
    if fmt.json_schema is None:
        raise InvalidRequest("`response_format.json_schema` is required with type json_schema.",
                             param="response_format.json_schema")
    return json_schema(fmt.json_schema.schema or {}, "response_format.json_schema.schema")


def structural_tag(fmt: ResponseFormat) -> bus.Constraint:
    """XGrammar's structural tag, checked for its shape here; the engine compiles it (its errors are a 400
    too). The spec is the format as vLLM takes it."""
    param = "response_format"
    if fmt.format is not None:
        if fmt.structures is not None or fmt.triggers is not None:
            raise InvalidRequest("A structural tag has either `format`, or `structures` and `triggers`.",
                                 param=f"{param}.format")
        spec: dict[str, Any] = {"type": "structural_tag", "format": fmt.format}
    else:
        if not fmt.structures or not fmt.triggers:
            raise InvalidRequest("A structural tag needs `structures` and `triggers` (or a `format`).",
                                 param=f"{param}.structures")
        for i, tag in enumerate(fmt.structures):
            if not any(tag.begin.startswith(trigger) for trigger in fmt.triggers):
                raise InvalidRequest("Each structure's `begin` must start with one of the `triggers`.",
                                     param=f"{param}.structures[{i}].begin")
        spec = {"type": "structural_tag", "triggers": fmt.triggers, "structures": [
            {"begin": tag.begin, "end": tag.end,
             "schema": checked_schema(tag.schema if tag.schema is not None else {}, f"{param}.structures[{i}].schema")}
            for i, tag in enumerate(fmt.structures)]}
    encoded = json_bytes(spec, param)  # a `format` is any object (beyond 254 levels it was a 500)
    if len(encoded) > MAX_SPEC_BYTES:
        raise InvalidRequest(f"`{param}` is larger than {MAX_SPEC_BYTES} bytes.", param=param)
    check_items(encoded, param)  # its structures' schemas together, or the schemas in its `format`
    return bus.Constraint(kind="structural_tag", spec=encoded.decode())


def of_text_format(kind: str, schema: dict[str, Any] | None) -> bus.Constraint | None:
    """Responses `text.format` (type, and the flat schema of a json_schema format)."""
    if kind == "json_object":
        return JSON_OBJECT
    if kind == "json_schema":
        return json_schema(schema or {}, "text.format.schema")
    return None


def of_structured_outputs(spec: StructuredOutputs | None) -> bus.Constraint | None:
    if spec is None:
        return None
    given = [name for name in ("json", "regex", "choice", "json_object", "grammar", "structural_tag")
             if getattr(spec, name) not in (None, False)]
    if len(given) > 1:
        raise InvalidRequest(f"`structured_outputs` takes one constraint; it has {', '.join(given)}.",
                             param=f"structured_outputs.{given[1]}")
    kind = given[0] if given else None
    param = f"structured_outputs.{kind}"
    if kind == "json":
        return json_schema(spec.json, param)
    if kind == "regex":
        return regex(spec.regex, param)
    if kind == "choice":
        if not spec.choice or not all(spec.choice) or len(orjson.dumps(spec.choice)) > MAX_SPEC_BYTES:
            raise InvalidRequest(f"`{param}` must be a list of non-empty strings, at most {MAX_SPEC_BYTES} bytes.",
                                 param=param)
        return bus.Constraint(kind="choice", spec=orjson.dumps(spec.choice).decode())
    if kind == "json_object":
        return JSON_OBJECT
    if kind is not None:
        raise InvalidRequest(f"`{param}` is not supported: only json, regex, choice and json_object are served.",
                             param=param, code="unsupported_parameter")
    return None


def only_one(*constraints: tuple[str, bus.Constraint | None]) -> bus.Constraint | None:
    """The request's constraint, from (field, constraint) pairs; a 400 when two fields ask for one (the engine
    applies a single grammar)."""
    given = [(name, c) for name, c in constraints if c is not None]
    if len(given) > 1:
        raise InvalidRequest(f"`{given[0][0]}` and `{given[1][0]}` cannot be combined: an answer is held to one "
                             "constraint.", param=given[1][0])
    return given[0][1] if given else None


def of_grammar(grammar: Grammar | None) -> bus.Constraint | None:
    if grammar is None:
        return None
    if grammar.type == "regex":
        return regex(grammar.value, "parameters.grammar.value")
    if grammar.type == "json_schema":  # TGI's JsonSchemaConfig: {"name": ..., "schema": ...}
        if not isinstance(grammar.value, dict) or "schema" not in grammar.value:
            raise InvalidRequest("A `json_schema` grammar's value is an object with the JSON schema in `schema`.",
                                 param="parameters.grammar.value.schema")
        return json_schema(grammar.value["schema"], "parameters.grammar.value.schema")
    return json_schema(grammar.value, "parameters.grammar.value")
