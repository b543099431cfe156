"""A job's text through its parsers, per choice: the `Tokens` events the engine makes are rewritten so that
`reasoning` is what the model thought, `text` the content and `tool_calls` the deltas of the calls found,
and a choice that made calls and stopped by itself ends with `tool_calls`.

A forced tool choice (required, or a named function) reads the constrained answer with the parser that
fits its shape; `auto` uses the worker's tool format; no tools, or tool_choice none, leaves the text alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import msgspec

from services.worker.parsing.formats import ToolFormat
from services.worker.parsing.reasoning import ReasoningFormat, ReasoningParser, Split
from services.worker.parsing.tools import CallIds, JsonParser, NamedParser, Parsed, ToolParser
from shared.protocol import bus


def call_id(job_id: str, choice: int, index: int) -> str:
    """The same on every worker for the same call, so that a job continued elsewhere keeps its calls' ids."""
    return "call_" + hashlib.sha256(f"{job_id}:{choice}:{index}".encode()).hexdigest()[:24]


class ChoiceOutput:
    """One choice's stages: the reasoning parser first, then the tool parser on the answer it leaves."""

    def __init__(self, parser: ToolParser | None, thinker: ReasoningParser | None = None,
                 max_calls: int | None = None) -> None:
        self.parser = parser
        self.thinker = thinker
        self.max_calls = max_calls
        """parallel_tool_calls false: the calls after the first are dropped (the model made them anyway)."""
        self.made_calls = False
        self.reasoning_tokens = 0
        self.undecided_tokens = 0
        """Tokens read before the parser knew whether they open a block."""

    def parse(self, text: str, finished: bool, tokens: int = 0) -> tuple[str, Parsed]:
        """The reasoning and the answer (content and calls) in this piece of text, made of `tokens` tokens:
        they count as reasoning when the model was thinking before or after them."""
        split = Split(content=text)
        if self.thinker is not None:
            split = self._think(text, finished, tokens)
        if self.parser is None:
            parsed = Parsed()
            parsed.add_text(split.content)
            return split.reasoning, parsed
        parsed = self.parser.feed(split.content)
        if finished:
            parsed.extend(self.parser.finish())
        if self.max_calls is not None:
            limit = self.max_calls
            parsed.pieces = [p for p in parsed.pieces if isinstance(p, str) or p.index < limit]
        self.made_calls = self.made_calls or bool(parsed.calls)
        return split.reasoning, parsed

    def _think(self, text: str, finished: bool, tokens: int) -> Split:
        """The reasoning parser's part; the tokens of an event count as reasoning when the model was thinking
        before, within or after them."""
        assert self.thinker is not None  # nosec B101: an invariant (tokenbus never runs with -O)
        was_thinking = self.thinker.thinking
        split = self.thinker.feed(text)
        if finished:
            split.extend(self.thinker.finish())
        if self.thinker.deciding and not finished:
            self.undecided_tokens += tokens
            return split
        if was_thinking or split.reasoning or self.thinker.thinking:
            self.reasoning_tokens += tokens + self.undecided_tokens
        self.undecided_tokens = 0
        return split


class JobOutput:
    """The parsers of one job's choices, made as each choice first speaks."""

    def __init__(self, job_id: str, make: Callable[[CallIds], ToolParser] | None,
                 think: Callable[[], ReasoningParser] | None = None, max_calls: int | None = None) -> None:
        self.job_id = job_id
        self.make = make
        self.think = think
        self.max_calls = max_calls
        self.choices: dict[int, ChoiceOutput] = {}

    def _choice(self, index: int) -> ChoiceOutput:
        if index not in self.choices:
            make = self.make
            parser = None if make is None else make(lambda n: call_id(self.job_id, index, n))
            thinker = None if self.think is None else self.think()
            self.choices[index] = ChoiceOutput(parser, thinker, self.max_calls)
        return self.choices[index]

    def rewrite(self, event: bus.Output) -> list[bus.Output]:
        """The event as the client gets it: usually one, more when content follows a call within it (so that
        content and calls keep their order); the first carries the tokens and the reasoning, the last the
        finish reason. The job's Final counts the reasoning tokens."""
        if isinstance(event, bus.Final):
            event.reasoning_tokens = sum(choice.reasoning_tokens for choice in self.choices.values())
            return [event]
        if not isinstance(event, bus.Tokens):
            return [event]
        choice = self._choice(event.choice)
        reasoning, parsed = choice.parse(event.text, event.finish_reason is not None, len(event.token_ids))
        runs = parsed.runs()
        finish = event.finish_reason
        if finish == "stop" and choice.made_calls:
            finish = "tool_calls"
        events: list[bus.Output] = []
        for i, (text, calls) in enumerate(runs):
            last = i == len(runs) - 1
            events.append(msgspec.structs.replace(
                event, text=text, tool_calls=calls, token_ids=[] if i else event.token_ids,
                logprobs=None if i else event.logprobs, finish_reason=finish if last else None,
                stop_reason=event.stop_reason if last else None, reasoning="" if i else reasoning))
        return events

    def resume(self, continuation: bus.Continuation, decode: Callable[[list[int]], str]) -> bool:
        """Brings each choice's parsers to where a former owner left them, by reading again the text of the
        tokens it generated; False when what that gives differs from what its client already has."""
        for index, token_ids in enumerate(continuation.token_ids):
            if not token_ids:
                continue
            choice = self._choice(index)
            if index < len(continuation.finished) and continuation.finished[index]:
                if choice.thinker is not None:  # its reasoning tokens still count in the usage
                    choice.parse(decode(token_ids), finished=True, tokens=len(token_ids))
                continue
            reasoning, parsed = choice.parse(decode(token_ids), finished=False, tokens=len(token_ids))
            calls: list[bus.ToolCall] = []
            bus.add_call_deltas(calls, parsed.calls)
            sent_text = continuation.texts[index] if index < len(continuation.texts) else ""
            sent_calls = continuation.calls[index] if index < len(continuation.calls) else []
            sent_reasoning = continuation.reasonings[index] if index < len(continuation.reasonings) else ""
            if parsed.text != sent_text or calls != sent_calls or reasoning != sent_reasoning:
                return False
        return True


def for_job(job: bus.Job, fmt: ToolFormat, reasoning: ReasoningFormat | None = None) -> JobOutput | None:
    """The parsers a chat job needs (with the worker's reasoning parser, if it has one and it can read the
    job's answer); None when its text goes out as it is."""
    if job.kind != "chat":
        return None
    think = None
    if reasoning is not None and not (reasoning.starts_inside and job.params.constraint is not None):
        think = reasoning.make
    use = job.tool_use
    if use is None or use.choice == "none":
        return None if think is None else JobOutput(job.id, None, think)
    if use.choice == "function":
        name = use.name
        return JobOutput(job.id, lambda ids: NamedParser(name, ids), think)
    if use.choice == "required":
        return JobOutput(job.id, JsonParser, think)
    return JobOutput(job.id, fmt.parser, think, max_calls=None if use.parallel else 1)
