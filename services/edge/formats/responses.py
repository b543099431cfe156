"""The OpenAI Responses API: requests, the conversation they continue, and the job a turn runs (its answer: see
response_render)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from services.edge.formats import calling, structured
from services.edge.formats.base import MAX_MESSAGES, Request, given, refuse, refuse_beyond_context, unbuilt
from services.edge.formats.common import PositiveInt, Sampling, TemplateKwargs, sampling_params, template_kwargs
from services.edge.store import Conversation
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""What `include` names to have the output text's logprobs (OpenAI's way to ask for them)."""
Includable = Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                     "message.input_image.image_url", "computer_call_output.output.image_url",
                     "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"]
"""OpenAI's IncludeEnum: any other value is a 400. Only the logprobs change an answer here; the others name
outputs of tools not served, or (encrypted reasoning) one never made: agents that always ask for it are served."""


class InputContent(Request):
    type: str
    text: str | None = None


class InputItem(Request):
    """A message (`type` message, or absent), a function call an earlier answer made (`function_call`:
    call_id, name, arguments), a call's result (`function_call_output`: call_id, output), or the reasoning
    an earlier answer began with (`reasoning`: summary and content texts)."""

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputContent] | None = None
    call_id: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    name: str | None = None
    arguments: str | dict[str, Any] | None = None
    """OpenAI: the JSON text; Databricks: an object or its text."""
    output: str | list[InputContent] | dict[str, Any] | None = None
    """A string, text parts, or (Databricks) a JSON object."""
    id: str | None = None
    status: str | None = None
    summary: list[InputContent] | None = None
    encrypted_content: str | None = None


class TextFormat(Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: structured.SchemaName | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextParam(Request):
    format: TextFormat | None = None


class ReasoningParam(Request):
    """`effort` reaches the template (and turns thinking on, as OVMS does); `summary` is accepted and not
    applied, as OVMS documents; Databricks' `encrypted_content` is refused by name (we never make any)."""

    effort: str | None = None
    summary: str | None = None
    encrypted_content: str | None = None


MetadataValue = Annotated[str, Meta(max_length=512)]
Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)], MetadataValue], Meta(max_length=16)]


class ResponsesRequest(Sampling, kw_only=True):
    """OpenAI's fields, and the sampling extras OVMS documents for /v3/responses (top_k, seed, stop, the
    penalties, ignore_eos, logprobs, response_format, chat_template_kwargs): each served or refused."""

    model: str
    input: Annotated[str, Meta(min_length=1)] | Annotated[list[InputItem], Meta(min_length=1,
                                                                                max_length=MAX_MESSAGES)] | None = None
    """Optional, as OpenAI's: a turn may run on its conversation's items alone (see check_length)."""
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    logprobs: bool | None = None
    include_stop_str_in_output: bool | None = None
    response_format: structured.ResponseFormat | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    best_of: int | None = None
    length_penalty: float | None = None
    num_assistant_tokens: int | None = None
    assistant_confidence_threshold: float | None = None
    max_ngram_size: int | None = None
    text: TextParam | None = None
    metadata: Metadata | None = None
    truncation: Literal["auto", "disabled"] | None = None
    store: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningParam | None = None
    parallel_tool_calls: bool | None = None
    tools: list[calling.ResponsesTool] | None = None
    tool_choice: calling.ToolChoice | None = None
    include: Annotated[list[Includable], Meta(max_length=16)] | None = None
    background: bool | None = None
    conversation: Any = None
    service_tier: str | None = None
    prompt: msgspec.Raw = unbuilt()


class InputTokensRequest(Request, kw_only=True):
    """POST /v1/responses/input_tokens: a response's input, counted as the model would read it (OpenAI's
    TokenCountsBody; a missing `model` is the edge's own)."""

    model: str = ""
    input: Annotated[str, Meta(min_length=1)] | Annotated[list[InputItem], Meta(min_length=1,
                                                                                max_length=MAX_MESSAGES)] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    tools: list[calling.ResponsesTool] | None = None
    tool_choice: calling.ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextParam | None = None
    reasoning: ReasoningParam | None = None
    truncation: Literal["auto", "disabled"] | None = None


def counted_request(counted: InputTokensRequest, model: str) -> ResponsesRequest:
    """The Responses request whose input a count is of: nothing stored, nothing run."""
    return ResponsesRequest(
        model=model, input=counted.input, instructions=counted.instructions,
        previous_response_id=counted.previous_response_id, conversation=counted.conversation, tools=counted.tools,
        tool_choice=counted.tool_choice, parallel_tool_calls=counted.parallel_tool_calls, text=counted.text,
        reasoning=counted.reasoning, truncation=counted.truncation, store=False)


def _refuse_decoding_extras(req: ResponsesRequest) -> None:
    """OVMS's beam-search and speculative-decoding fields: named, never ignored."""
    if req.n != 1:
        raise refuse("n", "a response has one output")
    if req.best_of not in (None, 1) or req.length_penalty not in (None, 1.0):
        raise refuse("best_of" if req.best_of not in (None, 1) else "length_penalty", "beam search is not served")
    for name in ("num_assistant_tokens", "assistant_confidence_threshold", "max_ngram_size"):
        if getattr(req, name) is not None:
            raise refuse(name, "speculative and prompt-lookup decoding are not served")


def refuse_unsupported(req: ResponsesRequest) -> None:
    """The 400s for what we do not serve, each naming its parameter."""
    if req.background and not req.store:
        raise InvalidRequest("A background response is stored: `background` needs `store` true.", param="store")
    if req.conversation is not None and req.previous_response_id:
        raise InvalidRequest("Give `conversation` or `previous_response_id`, not both.", param="conversation")
    if req.service_tier not in (None, "auto", "default"):
        raise refuse("service_tier", "there is one service tier")
    if given(req.prompt):
        raise refuse("prompt", "prompt templates are not served")
    if req.reasoning is not None and req.reasoning.encrypted_content:
        raise refuse("reasoning.encrypted_content", "this server returns no encrypted reasoning to send back; send "
                     "the reasoning item (its summary or content) instead")
    _refuse_decoding_extras(req)
    if req.response_format is not None and req.text and req.text.format and req.text.format.type != "text":
        raise InvalidRequest("Give the format once: `text.format` or `response_format`, not both.",
                             param="response_format")
    calling.responses_functions(req.tools)  # built-in tools are refused by name
    if req.text and req.text.format and req.text.format.type == "json_schema" and not req.text.format.name:
        raise InvalidRequest("`text.format.name` is required with type json_schema.", param="text.format.name")


def conversation_id(req: ResponsesRequest) -> str | None:
    """The Conversations-API conversation the turn runs in: its id, given as a string or as {"id": ...}."""
    given = req.conversation
    if given is None:
        return None
    found = given.get("id") if isinstance(given, dict) else given
    if not isinstance(found, str) or not found:
        raise InvalidRequest("`conversation` is a conversation id, or an object with its `id`.", param="conversation")
    return found


def input_items(req: ResponsesRequest) -> list[InputItem]:
    """The turn's input as items (a string is one user message)."""
    return [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input or []


def check_context(req: ResponsesRequest, max_model_len: int) -> None:
    """max_output_tokens must leave room for the input (truncation drops turns, never the budget)."""
    refuse_beyond_context(req.max_output_tokens, max_model_len, "max_output_tokens")


def _content_text(content: str | list[InputContent] | None, param: str) -> str:
    if content is None:
        raise InvalidRequest("A message item needs its `content`.", param=param)
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text", "text") or part.text is None:
            raise InvalidRequest(f"Content of type {part.type!r} is not supported by this text model.",
                                 param=f"{param}[{j}].type")
        texts.append(part.text)
    return "".join(texts)


def _parts(content: str | list[InputContent] | None) -> list[InputContent]:
    return content if isinstance(content, list) else []


def _message(item: InputItem, i: int) -> bus.Message:
    if item.role is None:
        raise InvalidRequest("A message item needs its `role`.", param=f"input[{i}].role")
    role = "system" if item.role == "developer" else item.role
    return bus.Message(role=role, content=_content_text(item.content, f"input[{i}].content"))


def _call(item: InputItem, i: int) -> bus.ToolCall:
    for name in ("call_id", "name", "arguments"):
        if getattr(item, name) is None:
            raise InvalidRequest(f"A function_call item needs its `{name}`.", param=f"input[{i}].{name}")
    assert item.call_id is not None and item.name is not None and item.arguments is not None  # nosec B101: an invariant (tokenbus never runs with -O)
    return bus.ToolCall(id=item.call_id, name=item.name,
                        arguments=calling.arguments_text(item.arguments, f"input[{i}].arguments"))


def _result(item: InputItem, i: int) -> bus.Message:
    if item.call_id is None:
        raise InvalidRequest("A function_call_output item needs the `call_id` it answers.", param=f"input[{i}].call_id")
    if item.output is None:
        raise InvalidRequest("A function_call_output item needs its `output`.", param=f"input[{i}].output")
    output = item.output
    text = (calling.arguments_text(output, f"input[{i}].output") if isinstance(output, dict)
            else _content_text(output, f"input[{i}].output"))
    return bus.Message(role="tool", content=text, tool_call_id=item.call_id)


def check_length(req: ResponsesRequest, conversation: Conversation, added: list[bus.Message]) -> None:
    """A conversation continued with `previous_response_id` holds at most MAX_MESSAGES messages, as one sent
    whole does (the history comes from the store, so the request struct cannot bound it); and at least one."""
    total = len(conversation.history) + len(added)
    if not total and not req.instructions:
        raise InvalidRequest("Give the `input` (or `instructions`, or a conversation to continue).", param="input")
    if total > MAX_MESSAGES:
        raise InvalidRequest(f"The conversation would hold {total} messages with the responses it continues; at "
                             f"most {MAX_MESSAGES} are served. Start a new one (with a summary of this one).",
                             param="previous_response_id" if req.previous_response_id else "input")


def input_messages(req: ResponsesRequest, history: list[bus.Message] | None = None) -> list[bus.Message]:
    """This turn's input as messages: a function_call joins the assistant turn before it (or starts one), a
    function_call_output is a `tool` message, and must answer a call made before it; a reasoning item's text
    goes with the assistant turn after it (its raw content, else its summary)."""
    if isinstance(req.input, str):
        return [bus.Message(role="user", content=req.input)]
    return messages_of(req.input or [], history)


def messages_of(items: list[InputItem], history: list[bus.Message] | None = None) -> list[bus.Message]:
    """Input items as messages (see input_messages), after the `history` they continue."""
    earlier = list(history or [])
    messages: list[bus.Message] = []
    params: list[str] = []
    thought = ""
    """The reasoning item just read: it goes with the assistant turn that follows it."""
    for i, item in enumerate(items):
        if item.type == "reasoning":
            thought += "".join(part.text or "" for part in _parts(item.content) or item.summary or [])
            continue
        if item.type == "function_call":
            call = _call(item, i)
            if messages and messages[-1].role == "assistant" and not thought:
                messages[-1].tool_calls.append(call)
                continue
            messages.append(bus.Message(role="assistant", content="", tool_calls=[call], reasoning=thought))
        elif item.type == "function_call_output":
            messages.append(_result(item, i))
        elif item.type == "message":
            message = _message(item, i)
            if message.role == "assistant":
                message.reasoning = thought
            messages.append(message)
        else:
            raise refuse(f"input[{i}].type", f"input items of type {item.type!r} are not served")
        params.append(f"input[{i}].call_id")
        thought = ""
    calling.check_results(earlier + messages, len(earlier), params)
    return messages


def _text_constraint(req: ResponsesRequest) -> bus.Constraint | None:
    if req.text and req.text.format and req.text.format.type != "text":
        return structured.of_text_format(req.text.format.type, req.text.format.schema)
    return structured.of_response_format(req.response_format)


def _tool_use(req: ResponsesRequest) -> bus.ToolUse | None:
    use = calling.tool_use(calling.bus_tools(calling.responses_functions(req.tools)), req.tool_choice,
                           req.parallel_tool_calls)
    formatted = (req.text and req.text.format and req.text.format.type != "text") or (
        req.response_format and req.response_format.type != "text")
    if use is not None and use.choice != "none" and formatted:
        raise InvalidRequest("`text.format` cannot be combined with tools the model may call: a constrained answer "
                             "cannot also make calls (set tool_choice to none).", param="text.format")
    return use


def to_job(
    req: ResponsesRequest, history: list[bus.Message], *, job_id: str, reply_to: str, deadline_ms: int
) -> bus.Job:
    """The job for this turn: instructions first, then the earlier turns, then the new input."""
    instructions = [bus.Message(role="system", content=req.instructions)] if req.instructions else []
    asked = req.logprobs or LOGPROBS_INCLUDE in (req.include or ())
    logprobs = req.top_logprobs if req.top_logprobs is not None else (0 if asked else None)
    params = sampling_params(req, max_tokens=req.max_output_tokens, logprobs=logprobs)
    params.include_stop_str_in_output = bool(req.include_stop_str_in_output)
    tool_use = _tool_use(req)
    params.constraint = structured.only_one(
        ("tool_choice", calling.forced_constraint(tool_use)), ("text.format", _text_constraint(req)),
        ("structured_outputs", structured.of_structured_outputs(req.structured_outputs)))
    effort = req.reasoning.effort if req.reasoning else None
    return bus.Job(
        id=job_id, model=req.model, reply_to=reply_to, deadline_ms=deadline_ms, kind="chat",
        messages=instructions + history, params=params, truncate=req.truncation == "auto",
        created_ms=bus.now_ms(), tool_use=tool_use, background=bool(req.background),
        cache_key=req.prompt_cache_key or "",
        # as OVMS does: any reasoning effort turns the template's thinking on
        chat_template_kwargs=template_kwargs(req.chat_template_kwargs, enable_thinking=True if effort else None,
                                             reasoning_effort=effort),
    )
