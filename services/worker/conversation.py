"""A chat job's messages as the dicts a chat template reads, and the tools it is given.

A template that uses `tools` gets the functions and the conversation's calls in the shape Hugging Face
templates expect (OpenAI's tool objects; `tool_calls` with the arguments as an object; `tool` messages with
their call's id and function name). A template that never mentions tools (SmolLM2's, for one) would drop
them, so the worker writes them itself in its tool format (`parsing.formats`): a system message that lists
the functions and says how to call them, earlier calls as the text the model would have written, results as
messages of role `tool`. No template is ever given `content: None`.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from services.worker.parsing.formats import ToolFormat, system_prompt
from shared import bus

_TOOLS = re.compile(r"\btools\b")


def template_uses_tools(template: Any) -> bool:
    """Whether a chat template (its text, or a dict of named ones) reads `tools` at all."""
    if isinstance(template, dict):
        return any(template_uses_tools(t) for t in template.values())
    return isinstance(template, str) and bool(_TOOLS.search(template))


def offered(job: bus.Job) -> list[bus.Tool]:
    """The functions the model is told about: none with tool_choice none (it must answer in words)."""
    use = job.tool_use
    return use.tools if use is not None and use.choice != "none" else []


def render(job: bus.Job, fmt: ToolFormat, native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages for the template and its `tools` argument (None when the template is not given any)."""
    if native:
        tools = [_tool(tool) for tool in offered(job)]
        return _native(job.messages), tools or None
    return _fallback(job, fmt), None


def _arguments(text: str) -> Any:
    """Templates write arguments with `tojson`: an object, when the text is one."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


def _tool(tool: bus.Tool) -> dict[str, Any]:
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.parameters or {"type": "object", "properties": {}}}}


def _native(messages: list[bus.Message]) -> list[dict[str, Any]]:
    names = {call.id: call.name for m in messages for call in m.tool_calls}
    out: list[dict[str, Any]] = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.reasoning:  # templates read one name or the other (Qwen3's reasoning_content)
            message["reasoning"] = message["reasoning_content"] = m.reasoning
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                                     for c in m.tool_calls]
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id
            message["name"] = names.get(m.tool_call_id, "")
        out.append(message)
    return out


def how_to_call(job: bus.Job, fmt: ToolFormat) -> str:
    """The format the model is asked for: its own, or the JSON a forced choice holds it to."""
    use = job.tool_use
    if use is not None and use.choice == "required":
        return ('Answer with only a JSON array of the calls to make, each {"name": <function-name>, '
                '"arguments": <args-json-object>}.')
    if use is not None and use.choice == "function":
        return f"Call the function {use.name}: answer with only its arguments, as a JSON object."
    return fmt.how_to_call


def _fallback(job: bus.Job, fmt: ToolFormat) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in job.messages:
        content = m.content
        if m.tool_calls:
            content = (content + "\n" if content else "") + fmt.write_calls(m.tool_calls)
        out.append({"role": m.role, "content": content})
    if tools := offered(job):
        block = system_prompt(tools, how_to_call(job, fmt))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}"
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
