"""The tool-call formats a worker can be set to (`--tool-parser`): how its model writes a call, so how to
find calls in its text, how to write the calls of earlier turns, and, for a chat template that knows nothing
of tools, how to tell the model about the functions and the format.

Open for more: `register(ToolFormat(...))` with a parser of the `tools.ToolParser` shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import orjson

from services.worker.parsing.tools import CallIds, JsonParser, TaggedParser, ToolParser
from shared.protocol import bus


@dataclass(frozen=True)
class ToolFormat:
    name: str
    parser: Callable[[CallIds], ToolParser]
    write_calls: Callable[[list[bus.ToolCall]], str]
    """An assistant's earlier calls as the model would have written them."""
    how_to_call: str
    """The part of the fallback system prompt that shows the format."""


def call_json(call: bus.ToolCall) -> str:
    """`{"name": ..., "arguments": ...}`, the arguments as they were written when they are JSON."""
    try:
        orjson.loads(call.arguments)
        arguments = call.arguments.strip()
    except orjson.JSONDecodeError:
        arguments = orjson.dumps(call.arguments).decode()
    return '{"name": ' + orjson.dumps(call.name).decode() + ', "arguments": ' + arguments + "}"


def tools_json(tools: list[bus.Tool]) -> list[str]:
    """Each function as the OpenAI tool object most models were trained on, one JSON text each."""
    return [orjson.dumps({"type": "function", "function": {
        "name": tool.name, "description": tool.description, "parameters": tool.parameters or {"type": "object"},
    }}).decode() for tool in tools]


def system_prompt(tools: list[bus.Tool], how_to_call: str) -> str:
    """What a model whose template ignores tools is told about them (Hermes' and Qwen's wording)."""
    listed = "\n".join(tools_json(tools))
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n"
            f"</tools>\n\n{how_to_call}")


def _tagged(calls: list[bus.ToolCall]) -> str:
    return "\n".join(f"<tool_call>\n{call_json(call)}\n</tool_call>" for call in calls)


def _plain(calls: list[bus.ToolCall]) -> str:
    if len(calls) == 1:
        return call_json(calls[0])
    return "[" + ", ".join(call_json(call) for call in calls) + "]"


TOOL_FORMATS: dict[str, ToolFormat] = {}


def register(fmt: ToolFormat) -> None:
    TOOL_FORMATS[fmt.name] = fmt


def tool_format(name: str) -> ToolFormat:
    """The format of that name; a ValueError naming the known ones otherwise."""
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool parser {name!r}: choose one of {', '.join(sorted(TOOL_FORMATS))}")
    return TOOL_FORMATS[name]


register(ToolFormat(
    name="hermes", parser=TaggedParser, write_calls=_tagged,
    how_to_call=("For each function call, return a json object with function name and arguments within "
                 "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                 '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'),
))
register(ToolFormat(
    name="json", parser=JsonParser, write_calls=_plain,
    how_to_call=('To call a function, answer with only a JSON object {"name": <function-name>, "arguments": '
                 "<args-json-object>}, or a JSON array of such objects to call several."),
))
