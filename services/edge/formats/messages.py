"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the request structs and the chat
job they become (services.edge.formats.messages_render has the answer, its stream events and the error shape).

A message's content is a string or a list of blocks: text; `tool_use` (an assistant's call) and `tool_result` (the
user's answer to one) map to the chat job's tool calls and tool messages; `thinking` to an assistant's reasoning;
images and documents are refused by name, as everywhere else. Each tool_result block is a message of its own to
the model: a message holds at most MAX_BLOCKS blocks, the conversation at most MAX_MESSAGES messages with its results
counted (checked before any is built), and each call takes one result. The answer's blocks come in the order the
model made them: its thinking (from the worker's reasoning parser), its text, then its calls (from the worker's tool
parser).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from services.edge.estimate import estimate
from services.edge.formats import calling, structured
from services.edge.formats.base import (
    MAX_MESSAGES,
    Request,
    StopList,
    given,
    refuse,
    refuse_beyond_context,
    stop_list,
    unbuilt,
)
from services.edge.formats.common import INT32_MAX, PositiveInt, template_kwargs
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest

MIN_THINKING_BUDGET = 1024
"""Anthropic's least `thinking.budget_tokens`."""
MAX_BLOCKS = MAX_MESSAGES
"""Content blocks of one message (or of the system prompt, or of a tool result): each of a user's tool_result
blocks becomes a message of its own, and the conversation holds at most MAX_MESSAGES (see check_length)."""
TURN_BLOCKS = ("text", "tool_use", "thinking")
"""The blocks that make a message's own turn (see _turn), after its tool results."""

# request


class ResultPart(Request):
    """A block of a tool result's content (text only: images are refused)."""

    type: str
    text: str | None = None


class ContentBlock(Request):
    """One block of a message: text, image, document, tool_use, tool_result, thinking or redacted_thinking."""

    type: str
    text: str | None = None
    id: str | None = None
    """tool_use: the call's id, which its tool_result names."""
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | Annotated[list[ResultPart], Meta(max_length=MAX_BLOCKS)] | None = None
    """tool_result: what the call returned."""
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    source: msgspec.Raw = unbuilt()
    cache_control: msgspec.Raw = unbuilt()
    citations: msgspec.Raw = unbuilt()


class InputMessage(Request):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Meta(max_length=MAX_BLOCKS)]


class SystemBlock(Request):
    type: str
    text: str | None = None
    cache_control: msgspec.Raw = unbuilt()


class Tool(Request):
    """A client tool: its name, what it does, the JSON schema of its input. Anthropic's server tools (web search,
    code execution, ...) have a `type` and are refused by name."""

    name: calling.FunctionName
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None
    cache_control: msgspec.Raw = unbuilt()


class ToolChoice(Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Request):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Meta(ge=MIN_THINKING_BUDGET, le=INT32_MAX)] | None = None
    display: str | None = None


class Prompting(Request):
    """What a Messages request and a count_tokens request share: the conversation and the tools."""

    model: str
    messages: Annotated[list[InputMessage], Meta(min_length=1, max_length=MAX_MESSAGES)]
    system: str | Annotated[list[SystemBlock], Meta(max_length=MAX_BLOCKS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(Prompting, kw_only=True):
    max_tokens: PositiveInt
    stop_sequences: StopList | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    """Anthropic's range is 0 to 1; vLLM's, which this follows, 0 to 2."""
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None
    structured_outputs: structured.StructuredOutputs | None = None
    """vLLM's extension, as on Chat Completions: a regex, a choice or a JSON schema the answer is held to."""
    metadata: msgspec.Raw = unbuilt()
    service_tier: str | None = None
    container: msgspec.Raw = unbuilt()
    mcp_servers: msgspec.Raw = unbuilt()


class CountTokensRequest(Prompting, kw_only=True):
    pass


def _text(blocks: Sequence[ResultPart | SystemBlock], param: str) -> str:
    texts = []
    for j, block in enumerate(blocks):
        if block.type != "text" or block.text is None:
            raise InvalidRequest(f"Content blocks of type {block.type!r} are not supported here by this text "
                                 "model; use 'text'.", param=f"{param}[{j}].type")
        texts.append(block.text)
    return "".join(texts)


def _system(req: Prompting) -> list[bus.Message]:
    if req.system is None:
        return []
    content = req.system if isinstance(req.system, str) else _text(req.system, "system")
    return [bus.Message(role="system", content=content)]


def _result(block: ContentBlock, param: str) -> bus.Message:
    if not block.tool_use_id:
        raise InvalidRequest("A tool_result block needs the `tool_use_id` of the call it answers.",
                             param=f"{param}.tool_use_id")
    content = block.content or ""
    text = content if isinstance(content, str) else _text(content, f"{param}.content")
    return bus.Message(role="tool", content=f"Error: {text}" if block.is_error else text,
                       tool_call_id=block.tool_use_id)


def _call(block: ContentBlock, param: str) -> bus.ToolCall:
    if not block.id or not block.name:
        raise InvalidRequest("A tool_use block needs its `id` and `name`.", param=param)
    return bus.ToolCall(id=block.id, name=block.name, arguments=msgspec.json.encode(block.input or {}).decode())


def _expanded(message: InputMessage) -> int:
    """How many chat messages `message` becomes (see _turn), counted without building them."""
    if isinstance(message.content, str):
        return 1
    results = sum(block.type == "tool_result" for block in message.content)
    return results + any(block.type in TURN_BLOCKS for block in message.content)


def check_length(req: Prompting) -> None:
    """The conversation holds at most MAX_MESSAGES messages once each tool_result block is a message of its own
    (the schema bounds the request's messages and their blocks, not what they become): counted before any is
    built, as the first check after decoding."""
    total = sum(map(_expanded, req.messages))
    if total > MAX_MESSAGES:
        raise InvalidRequest(f"`messages` holds {total} messages once each tool_result block is counted as one (it "
                             f"is a message of its own to the model); at most {MAX_MESSAGES} are served.",
                             param="messages")


def _turn(message: InputMessage, index: int) -> tuple[list[bus.Message], list[str]]:
    """One message of the request as chat messages: a user's tool results first, each a tool message of its own;
    with where each was given (a result's call id, else the message's content)."""
    if isinstance(message.content, str):
        return [bus.Message(role=message.role, content=message.content)], [f"messages[{index}].content"]
    results: list[bus.Message] = []
    params: list[str] = []
    texts: list[str] = []
    calls: list[bus.ToolCall] = []
    reasoning: list[str] = []
    for j, block in enumerate(message.content):
        param = f"messages[{index}].content[{j}]"
        match (block.type, message.role):
            case ("text", _):
                texts.append(block.text or "")
            case ("tool_result", "user"):
                results.append(_result(block, param))
                params.append(f"{param}.tool_use_id")
            case ("tool_use", "assistant"):
                calls.append(_call(block, param))
            case ("thinking", "assistant"):
                reasoning.append(block.thinking or "")
            case ("redacted_thinking", "assistant"):
                pass  # opaque, and nothing this model made
            case ("tool_result" | "tool_use" | "thinking" | "redacted_thinking", _):
                raise InvalidRequest(f"A {message.role} message cannot hold a {block.type} block.",
                                     param=f"{param}.type")
            case _:
                raise InvalidRequest(f"Content blocks of type {block.type!r} are not supported by this text model; "
                                     "use 'text'.", param=f"{param}.type")
    if not (texts or calls or reasoning):
        return results, params
    return [*results, bus.Message(role=message.role, content="".join(texts), tool_calls=calls,
                                  reasoning="".join(reasoning))], [*params, f"messages[{index}].content"]


def _messages(req: Prompting) -> list[bus.Message]:
    check_length(req)
    messages = _system(req)
    params: list[str] = ["system"] * len(messages)
    for i, message in enumerate(req.messages):
        turn, where = _turn(message, i)
        messages += turn
        params += where
    calling.check_results(messages, 0, params)
    return messages


def _tool_use(req: Prompting) -> bus.ToolUse | None:
    functions = []
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise refuse(f"tools[{i}]", f"the server tool {tool.type!r} is not served")
        functions.append((calling.FunctionDef(name=tool.name, description=tool.description,
                                              parameters=tool.input_schema), f"tools[{i}]"))
    offered = calling.bus_tools(functions)
    choice = req.tool_choice
    if choice is None:
        return calling.tool_use(offered, None, None)
    if choice.type == "tool" and not choice.name:
        raise InvalidRequest("A tool_choice of type 'tool' needs the `name` of the tool.", param="tool_choice.name")
    named = calling.NamedChoice(type="function", name=choice.name)
    given = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type, named)
    parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
    return calling.tool_use(offered, given, parallel)  # type: ignore[arg-type]


def _thinking(req: Prompting, max_tokens: int | None) -> str | None:
    """The reasoning effort the chat template is given: "none" when thinking is disabled."""
    thinking = req.thinking
    if thinking is None:
        return None
    if thinking.type == "enabled":
        if thinking.budget_tokens is None:
            raise InvalidRequest("Enabled thinking needs its `budget_tokens`.", param="thinking.budget_tokens")
        if max_tokens is not None and thinking.budget_tokens >= max_tokens:
            raise InvalidRequest("`thinking.budget_tokens` must be less than `max_tokens`.",
                                 param="thinking.budget_tokens")
    return "none" if thinking.type == "disabled" else None


def _refuse_unsupported(req: MessagesRequest) -> None:
    if given(req.mcp_servers):
        raise refuse("mcp_servers", "MCP servers are not reached from this service")
    if given(req.container):
        raise refuse("container", "code execution containers are not served")


def check_context(req: MessagesRequest, max_model_len: int) -> None:
    refuse_beyond_context(req.max_tokens, max_model_len, "max_tokens")


def to_job(req: MessagesRequest, *, job_id: str, reply_to: str, deadline_ms: int) -> bus.Job:
    """Validates what the schema cannot express and builds the chat job."""
    _refuse_unsupported(req)
    tool_use = _tool_use(req)
    params = bus.SamplingParams(
        max_tokens=req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
        stop=stop_list(req.stop_sequences, "stop_sequences"))
    params.constraint = structured.only_one(
        ("tool_choice", calling.forced_constraint(tool_use)),
        ("structured_outputs", structured.of_structured_outputs(req.structured_outputs)))
    return bus.Job(
        id=job_id, model=req.model, reply_to=reply_to, deadline_ms=deadline_ms, kind="chat",
        messages=_messages(req), params=params, created_ms=bus.now_ms(), tool_use=tool_use,
        chat_template_kwargs=template_kwargs(None, reasoning_effort=_thinking(req, req.max_tokens)),
    )


def count_job(req: CountTokensRequest, *, job_id: str, reply_to: str, deadline_ms: int) -> bus.Job:
    """The job of a count_tokens request: its prompt as the worker renders it for a Messages request, counted and
    not run (one output token in its budget, which admission charges and the count settles)."""
    return bus.Job(
        id=job_id, model=req.model, reply_to=reply_to, deadline_ms=deadline_ms, kind="chat", count_only=True,
        messages=_messages(req), params=bus.SamplingParams(max_tokens=1), created_ms=bus.now_ms(),
        tool_use=_tool_use(req), chat_template_kwargs=template_kwargs(None, reasoning_effort=_thinking(req, None)),
    )


def input_estimate(job: bus.Job, max_model_len: int) -> int:
    """The prompt tokens the edge expects (message_start's figure until the engine counts them)."""
    return estimate(job, max_model_len)[0]

