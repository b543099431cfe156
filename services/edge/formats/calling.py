"""Function calling at the edge: the tools a request offers (Chat's nested form, the Responses API's flat one
and the nested one OVMS also accepts), the tool choice, and the checks that keep bad definitions off the
queue: at most 128 functions (OpenAI's limit), their parameters at most MAX_TOOLS_BYTES of JSON all together (what
checking and compiling them costs), unique names, valid JSON schemas that describe objects.

A forced choice (`required`, or a named function) becomes a structured-output constraint built from the
functions' parameters, so the engine itself guarantees that the arguments validate: `required` holds the
answer to a JSON array of `{"name", "arguments"}` (exactly one item with `parallel_tool_calls: false`), a
named function to its arguments object. With `auto` the worker's tool parser finds calls in free text.
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Any, Literal, TypeAlias

from msgspec import Meta

from services.edge.formats import structured
from services.edge.formats.base import Request, refuse
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest

MAX_FUNCTIONS = 128
"""OpenAI's limit on `tools` (Databricks' is 32, with 15 properties a function: agents' tools often take more, and
the functions' bytes bound what they cost)."""
MAX_TOOLS_BYTES = 2 * structured.MAX_SPEC_BYTES
"""A forced choice holds the answer to all the functions at once, in one grammar of at most MAX_SPEC_BYTES."""
FunctionName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
"""OpenAI's rule for function names (letters, digits, underscores, dashes; dots for namespaces), 64 at most."""
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
"""What a function without `parameters` takes: nothing (OpenAI: "an empty parameter list")."""
DEFS_KEYS = ("$defs", "definitions")


class FunctionDef(Request):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Request):
    """Chat Completions: `{"type": "function", "function": {...}}`."""

    type: str
    function: FunctionDef | None = None


class ResponsesTool(Request):
    """The Responses API: OpenAI's flat function `{"type": "function", "name", "parameters", ...}`, the nested
    form OVMS accepts `{"type": "function", "function": {...}}`, or a built-in tool (refused by name)."""

    type: str
    name: FunctionName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    function: FunctionDef | None = None


class FunctionRef(Request):
    name: str


class NamedChoice(Request):
    """A forced function: Chat's `{"type": "function", "function": {"name"}}` or the Responses API's flat
    `{"type": "function", "name"}`."""

    type: str
    function: FunctionRef | None = None
    name: str | None = None


ToolChoice: TypeAlias = Literal["none", "auto", "required"] | NamedChoice


def chat_functions(tools: list[ChatTool] | None) -> list[tuple[FunctionDef, str]]:
    """The functions of Chat's `tools`, each with where it was given (for errors)."""
    out = []
    for i, tool in enumerate(tools or []):
        if tool.type != "function":
            raise refuse(f"tools[{i}].type", f"only function tools are served, not {tool.type!r}")
        if tool.function is None:
            raise InvalidRequest("A function tool needs its `function`.", param=f"tools[{i}].function")
        out.append((tool.function, f"tools[{i}].function"))
    return out


def responses_functions(tools: list[ResponsesTool] | None) -> list[tuple[FunctionDef, str]]:
    """The functions of the Responses API's `tools`, flat or nested."""
    out = []
    for i, tool in enumerate(tools or []):
        if tool.type != "function":
            raise refuse(f"tools[{i}]", f"the built-in tool {tool.type!r} is not served")
        if tool.function is not None:
            out.append((tool.function, f"tools[{i}].function"))
        elif tool.name is None:
            raise InvalidRequest("A function tool needs its `name`.", param=f"tools[{i}].name")
        else:
            flat = FunctionDef(name=tool.name, description=tool.description, parameters=tool.parameters,
                               strict=tool.strict)
            out.append((flat, f"tools[{i}]"))
    return out


def _parameters(function: FunctionDef, param: str) -> dict[str, Any]:
    param = f"{param}.parameters"
    if function.parameters is None:
        return {}
    schema = structured.checked_schema(function.parameters, param)
    if schema.get("type", "object") != "object":
        raise InvalidRequest(f"`{param}` must describe an object (type object): the arguments are one.", param=param)
    return schema


def _check_size(functions: list[tuple[FunctionDef, str]]) -> None:
    """All the functions' parameters together, before any is checked: each check costs by the byte."""
    total = 0
    for function, param in functions:
        if function.parameters is not None:
            total += len(structured.json_bytes(function.parameters, f"{param}.parameters"))
    if total > MAX_TOOLS_BYTES:
        raise InvalidRequest(f"The functions' parameters take {total} bytes of JSON; at most {MAX_TOOLS_BYTES} "
                             "are served in one request.", param="tools")


def bus_tools(functions: list[tuple[FunctionDef, str]]) -> list[bus.Tool]:
    """The functions, checked, as the worker gets them."""
    if len(functions) > MAX_FUNCTIONS:
        raise InvalidRequest(f"`tools` lists {len(functions)} functions; at most {MAX_FUNCTIONS} are served.",
                             param="tools")
    _check_size(functions)
    seen: set[str] = set()
    out = []
    for function, param in functions:
        if function.name in seen:
            raise InvalidRequest(f"Two functions are named {function.name!r}; names must be unique.",
                                 param=f"{param}.name")
        seen.add(function.name)
        out.append(bus.Tool(name=function.name, description=function.description or "",
                            parameters=_parameters(function, param), strict=bool(function.strict)))
    return out


def _named(choice: NamedChoice, names: set[str]) -> str:
    if choice.type != "function":
        raise refuse("tool_choice", f"a tool choice of type {choice.type!r} is not served; use none, auto, "
                                    "required or a function")
    name, param = ((choice.function.name, "tool_choice.function.name") if choice.function is not None
                   else (choice.name, "tool_choice.name"))
    if not name:
        raise InvalidRequest("A function tool choice needs the function's `name`.", param="tool_choice")
    if name not in names:
        raise InvalidRequest(f"`tool_choice` names {name!r}, which is not one of the `tools`.", param=param)
    return name


def tool_use(tools: list[bus.Tool], choice: ToolChoice | None, parallel: bool | None) -> bus.ToolUse | None:
    """How the model may call the functions (None: no functions offered)."""
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none" and choice != "auto":
            raise InvalidRequest("`tool_choice` asks for a call, but `tools` offers no function.",
                                 param="tool_choice")
        return None
    if isinstance(choice, NamedChoice):
        name = _named(choice, {tool.name for tool in tools})
        return bus.ToolUse(tools=tools, choice="function", name=name, parallel=parallel is not False)
    return bus.ToolUse(tools=tools, choice=choice, parallel=parallel is not False)


def _lift_defs(tools: list[bus.Tool]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Each function's parameters with their `$defs` moved to the top of the combined schema, where the
    parameters' own `#/$defs/...` references point. Definitions that are no object stay where they are: the
    schema may be of a draft without `$defs` (draft 4's `"$defs": 5` is valid), or not checked yet."""
    lifted: dict[str, dict[str, Any]] = {}
    schemas = []
    for tool in tools:
        schema = dict(tool.parameters or NO_PARAMETERS)
        for key in DEFS_KEYS:
            if not isinstance(schema.get(key), dict):
                continue
            definitions: dict[str, Any] = schema.pop(key)
            for name, definition in definitions.items():
                if lifted.setdefault(key, {}).setdefault(name, definition) != definition:
                    raise InvalidRequest(f"Two functions define `{key}.{name}` differently; a forced tool choice "
                                         "needs one definition.", param="tools")
        schemas.append(schema)
    return schemas, lifted


def forced_constraint(use: bus.ToolUse | None) -> bus.Constraint | None:
    """The constraint of a forced choice; None for auto and none."""
    if use is None or use.choice not in ("required", "function"):
        return None
    if use.choice == "function":
        [tool] = [tool for tool in use.tools if tool.name == use.name]
        return structured.json_schema(tool.parameters or NO_PARAMETERS, "tools")
    schemas, defs = _lift_defs(use.tools)
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.name]}, "arguments": schema},
              "required": ["name", "arguments"], "additionalProperties": False}
             for tool, schema in zip(use.tools, schemas, strict=True)]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **defs}
    if not use.parallel:
        array["maxItems"] = 1
    return structured.json_schema(array, "tools")


def arguments_text(arguments: str | dict[str, Any], param: str) -> str:
    """A call's arguments (or a result given as an object) as JSON text: Databricks documents them as an object,
    OpenAI as its text. An object JSON cannot carry on is a 400 naming `param` (it was a 500)."""
    return arguments if isinstance(arguments, str) else structured.json_bytes(arguments, param).decode()


def check_results(messages: list[bus.Message], first: int, params: list[str]) -> None:
    """Every tool result from message `first` on answers a call made before it, and one not answered yet
    (`params[i]` names message `first + i`'s call id in the request). A call takes one result: OpenAI refuses a
    second `tool_call_id` for one call ("Duplicate value for 'tool_call_id'"), Anthropic a second `tool_result`
    for one `tool_use_id`, and Mistral counts calls and results as a multiset. A later assistant message that
    makes a call of the same id again makes a new call, answered again: some models' ids restart each turn (Kimi
    K2's `functions.get_weather:0`). The messages before `first` (the turns a request continues, checked when
    they were sent) only open and answer calls."""
    made: set[str] = set()
    unanswered: Counter[str] = Counter()
    for i, message in enumerate(messages):
        for call in message.tool_calls:
            made.add(call.id)
            unanswered[call.id] += 1
        if message.role != "tool":
            continue
        call_id = message.tool_call_id
        if unanswered[call_id] > 0:
            unanswered[call_id] -= 1
        elif i >= first:
            param = params[i - first]
            if call_id in made:
                raise InvalidRequest(f"A second tool result answers the call {call_id!r} (at `{param}`); each "
                                     "call takes one result.", param=param)
            raise InvalidRequest(f"A tool result answers the call {call_id!r}, which no earlier assistant message "
                                 "made.", param=param)
