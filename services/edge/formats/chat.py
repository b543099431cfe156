"""OpenAI Chat Completions: the request structs, the job they become, and the chunk renderer."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from services.edge.formats import calling, structured
from services.edge.formats.base import (
    MAX_MESSAGES,
    TEXT_MARK,
    Choices,
    OpenAIStreamEnd,
    Out,
    Payload,
    Request,
    TextTemplate,
    Usage,
    finish_reason,
    given,
    refuse,
    refuse_beyond_context,
    unbuilt,
    usage_of,
)
from services.edge.formats.common import (
    PositiveInt,
    Sampling,
    TemplateKwargs,
    TokenLogprobOut,
    sampling_params,
    template_kwargs,
    token_logprobs_out,
)
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest

# request


class ContentPart(Request):
    type: str
    text: str | None = None


class CalledFunction(Request):
    name: str
    arguments: str | dict[str, Any]


class MessageToolCall(Request):
    """A call an assistant made earlier in the conversation."""

    id: Annotated[str, Meta(min_length=1, max_length=256)]
    function: CalledFunction
    type: str = "function"


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    """Role assistant: the calls it made."""
    tool_call_id: str | None = None
    """Role tool: the call whose result this is."""
    reasoning: str | None = None
    """Role assistant: its reasoning, as vLLM returns it (`reasoning_content` is the older name)."""
    reasoning_content: str | None = None


class ChatCompletionRequest(Sampling, kw_only=True):
    model: str
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    """Accepted for every model; a model that does not reason has nothing to spend it on."""
    response_format: structured.ResponseFormat | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    """vLLM's extension: variables for the model's chat template (reasoning_effort reaches it too)."""
    tools: list[calling.ChatTool] | None = None
    tool_choice: calling.ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: msgspec.Raw = unbuilt()
    function_call: msgspec.Raw = unbuilt()
    audio: msgspec.Raw = unbuilt()
    modalities: list[str] | None = None
    prediction: msgspec.Raw = unbuilt()
    web_search_options: msgspec.Raw = unbuilt()


def _text_of(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise InvalidRequest(
                f"Content parts of type {part.type!r} are not supported by this text model; use 'text'.",
                param=f"messages[{index}].content[{j}].type",
            )
        texts.append(part.text)
    return "".join(texts)


def _refuse_unsupported(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("`top_logprobs` needs `logprobs` set to true.", param="top_logprobs")
    if given(req.functions):
        raise refuse("functions", "use `tools`, which replaced `functions`")
    for name in ("function_call", "audio", "prediction", "web_search_options"):
        if given(getattr(req, name)):
            raise refuse(name, "it is not served by this text model")
    if req.modalities and set(req.modalities) != {"text"}:
        raise refuse("modalities", "only text output is served")


def check_context(req: ChatCompletionRequest, max_model_len: int) -> None:
    """The budget the job runs with (max_completion_tokens wins) must leave room for the prompt."""
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    refuse_beyond_context(getattr(req, param), max_model_len, param)


def _calls(message: ChatMessage, index: int) -> list[bus.ToolCall]:
    if not message.tool_calls:
        return []
    if message.role != "assistant":
        raise InvalidRequest("Only assistant messages carry `tool_calls`.", param=f"messages[{index}].tool_calls")
    for j, call in enumerate(message.tool_calls):
        if call.type != "function":
            raise refuse(f"messages[{index}].tool_calls[{j}].type", "only function calls are served")
    return [bus.ToolCall(id=c.id, name=c.function.name, arguments=calling.arguments_text(
        c.function.arguments, f"messages[{index}].tool_calls[{j}].function.arguments"))
            for j, c in enumerate(message.tool_calls)]


def _message(message: ChatMessage, index: int) -> bus.Message:
    if message.role == "tool" and not message.tool_call_id:
        raise InvalidRequest("A tool message needs the `tool_call_id` of the call it answers.",
                             param=f"messages[{index}].tool_call_id")
    return bus.Message(role="system" if message.role == "developer" else message.role,
                       content=_text_of(message, index), tool_calls=_calls(message, index),
                       tool_call_id=(message.tool_call_id or "") if message.role == "tool" else "",
                       reasoning=(message.reasoning or message.reasoning_content or "")
                       if message.role == "assistant" else "")


def _tool_use(req: ChatCompletionRequest) -> bus.ToolUse | None:
    offered = calling.bus_tools(calling.chat_functions(req.tools))
    use = calling.tool_use(offered, req.tool_choice, req.parallel_tool_calls)
    if use is not None and use.choice != "none" and req.response_format and req.response_format.type != "text":
        raise InvalidRequest("`response_format` cannot be combined with tools the model may call: a constrained "
                             "answer cannot also make calls (set tool_choice to none).", param="response_format")
    return use


def to_job(req: ChatCompletionRequest, *, job_id: str, reply_to: str, deadline_ms: int) -> bus.Job:
    """Validates what the schema cannot express and builds the internal job."""
    _refuse_unsupported(req)
    messages = [_message(m, i) for i, m in enumerate(req.messages)]
    calling.check_results(messages, 0, [f"messages[{i}].tool_call_id" for i in range(len(messages))])
    params = sampling_params(req, max_tokens=req.max_completion_tokens or req.max_tokens,
                             logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    tool_use = _tool_use(req)
    params.constraint = structured.only_one(
        ("tool_choice", calling.forced_constraint(tool_use)),
        ("response_format", structured.of_response_format(req.response_format)),
        ("structured_outputs", structured.of_structured_outputs(req.structured_outputs)))
    return bus.Job(
        id=job_id, model=req.model, reply_to=reply_to, deadline_ms=deadline_ms, kind="chat",
        messages=messages, params=params, created_ms=bus.now_ms(), tool_use=tool_use,
        cache_key=req.prompt_cache_key or "",
        chat_template_kwargs=template_kwargs(req.chat_template_kwargs, reasoning_effort=req.reasoning_effort),
    )


# response


class ChoiceLogprobs(Out):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class FunctionChunk(Out, kw_only=True):
    name: str | UnsetType = UNSET
    arguments: str


class ToolCallChunk(Out, kw_only=True):
    """A call's first chunk has its id, type and name (arguments ""); the following ones argument fragments."""

    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: FunctionChunk


class Delta(Out, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET
    """vLLM's field for what a reasoning model thought (`reasoning_content` its older name, still read by
    many clients): both are sent."""
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCallChunk] | UnsetType = UNSET


class ChunkChoice(Out, kw_only=True):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Out, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | UnsetType | None = UNSET


class CalledFunctionOut(Out):
    name: str
    arguments: str


class ToolCallOut(Out, kw_only=True):
    id: str
    type: str = "function"
    function: CalledFunctionOut


class ResponseMessage(Out, kw_only=True):
    role: str = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET


def response_message(text: str, calls: list[bus.ToolCall], reasoning: str = "") -> ResponseMessage:
    """The answer: its content (null when it only made calls), its calls, and what the model thought first."""
    thought = reasoning or UNSET
    if not calls:
        return ResponseMessage(content=text, reasoning=thought, reasoning_content=thought)
    return ResponseMessage(content=text or None, reasoning=thought, reasoning_content=thought, tool_calls=[
        ToolCallOut(id=c.id, function=CalledFunctionOut(name=c.name, arguments=c.arguments)) for c in calls])


def tool_call_chunks(deltas: list[bus.ToolCallDelta]) -> list[ToolCallChunk]:
    chunks = []
    for delta in deltas:
        if delta.id:
            chunks.append(ToolCallChunk(index=delta.index, id=delta.id, type="function",
                                        function=FunctionChunk(name=delta.name, arguments="")))
        if delta.arguments:
            chunks.append(ToolCallChunk(index=delta.index, function=FunctionChunk(arguments=delta.arguments)))
    return chunks


class Choice(Out, kw_only=True):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(Out, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class ChatRenderer(OpenAIStreamEnd):
    """Chat Completions as a state machine: per choice a role chunk, content chunks, a finish chunk;
    then the usage chunk when asked for."""

    def __init__(self, req: ChatCompletionRequest, *, response_id: str, created: int) -> None:
        self.id = response_id
        self.created = created
        self.model = req.model
        self.include_usage = req.include_usage
        self.with_logprobs = bool(req.logprobs)
        self.choices = Choices(req.n)
        self.started = [False] * req.n
        self.content: list[TextTemplate | None] = [None] * req.n
        """Per choice, the frame of a plain content token (no logprobs, not the last)."""

    def _chunk(self, choices: list[ChunkChoice], usage: Usage | UnsetType | None = UNSET) -> ChatCompletionChunk:
        if usage is UNSET and self.include_usage:
            usage = None
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def render(self, event: bus.Output) -> list[Payload]:
        if isinstance(event, bus.Final):
            self.choices.final = event
            return [self._chunk([], usage_of(event, details=True))] if self.include_usage else []
        if not isinstance(event, bus.Tokens):
            return []
        self.choices.add(event)
        out: list[Payload] = []
        i = event.choice
        if not self.started[i]:
            self.started[i] = True
            out.append(self._chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))]))
        logprobs = ChoiceLogprobs(content=token_logprobs_out(event.logprobs or [])) if self.with_logprobs else None
        if event.reasoning:  # the tokens' logprobs go with the content when there is some
            out.append(self._chunk([ChunkChoice(index=i, delta=Delta(
                reasoning=event.reasoning, reasoning_content=event.reasoning),
                logprobs=None if event.text else logprobs)]))
        if event.text and event.finish_reason is None and not self.with_logprobs and not event.tool_calls:
            out.append(self._content_template(i).fill(event.text))  # most tokens
        elif event.text or (event.logprobs and not event.reasoning):
            out.append(self._chunk([ChunkChoice(index=i, delta=Delta(content=event.text), logprobs=logprobs)]))
        out.extend(self._chunk([ChunkChoice(index=i, delta=Delta(tool_calls=[chunk]))])
                   for chunk in tool_call_chunks(event.tool_calls))
        if event.finish_reason is not None:
            reason = finish_reason(event.finish_reason)
            out.append(self._chunk([ChunkChoice(index=i, delta=Delta(), finish_reason=reason)]))
        return out

    def _content_template(self, i: int) -> TextTemplate:
        template = self.content[i]
        if template is None:
            template = self.content[i] = TextTemplate(
                self._chunk([ChunkChoice(index=i, delta=Delta(content=TEXT_MARK))]))
        return template

    def body(self) -> ChatCompletion:
        choices = [
            Choice(
                index=i,
                message=response_message(self.choices.text(i), self.choices.calls[i], self.choices.reasoning(i)),
                logprobs=ChoiceLogprobs(content=token_logprobs_out(self.choices.logprobs[i]))
                if self.with_logprobs else None,
                finish_reason=finish_reason(reason),
            )
            for i, reason in enumerate(self.choices.finish_reasons)
        ]
        final = self.choices.final or bus.Final(job=self.id, prompt_tokens=0, completion_tokens=0)
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices,
                              usage=usage_of(final, details=True))
