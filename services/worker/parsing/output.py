"""A job's text through its parsers, per choice: the `Tokens` events the engine makes are rewritten so that
`text` is the content and `tool_calls` the deltas of the calls found, and a choice that made calls and
stopped by itself ends with `tool_calls`.

A forced tool choice (required, or a named function) reads the constrained answer with the parser that
fits its shape; `auto` uses the worker's tool format; no tools, or tool_choice none, leaves the text alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import msgspec

from services.worker.parsing.formats import ToolFormat
from services.worker.parsing.tools import CallIds, JsonParser, NamedParser, Parsed, ToolParser
from shared import bus


def call_id(job_id: str, choice: int, index: int) -> str:
    """The same on every worker for the same call, so that a job continued elsewhere keeps its calls' ids."""
    return "call_" + hashlib.sha256(f"{job_id}:{choice}:{index}".encode()).hexdigest()[:24]


class ChoiceOutput:
    """One choice's stages. Today one (the tool parser); a reasoning parser goes before it, on the same text."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        """parallel_tool_calls false: the calls after the first are dropped (the model made them anyway)."""
        self.made_calls = False

    def parse(self, text: str, finished: bool) -> Parsed:
        parsed = self.parser.feed(text)
        if finished:
            parsed.extend(self.parser.finish())
        if self.max_calls is not None:
            limit = self.max_calls
            parsed.pieces = [p for p in parsed.pieces if isinstance(p, str) or p.index < limit]
        self.made_calls = self.made_calls or bool(parsed.calls)
        return parsed


class JobOutput:
    """The parsers of one job's choices, made as each choice first speaks."""

    def __init__(self, job_id: str, make: Callable[[CallIds], ToolParser], max_calls: int | None = None) -> None:
        self.job_id = job_id
        self.make = make
        self.max_calls = max_calls
        self.choices: dict[int, ChoiceOutput] = {}

    def _choice(self, index: int) -> ChoiceOutput:
        if index not in self.choices:
            parser = self.make(lambda n: call_id(self.job_id, index, n))
            self.choices[index] = ChoiceOutput(parser, self.max_calls)
        return self.choices[index]

    def rewrite(self, event: bus.Output) -> list[bus.Output]:
        """The event as the client gets it: usually one, more when content follows a call within it (so that
        content and calls keep their order); the first carries the tokens, the last the finish reason."""
        if not isinstance(event, bus.Tokens):
            return [event]
        choice = self._choice(event.choice)
        runs = choice.parse(event.text, event.finish_reason is not None).runs()
        finish = event.finish_reason
        if finish == "stop" and choice.made_calls:
            finish = "tool_calls"
        events: list[bus.Output] = []
        for i, (text, calls) in enumerate(runs):
            last = i == len(runs) - 1
            events.append(msgspec.structs.replace(
                event, text=text, tool_calls=calls, token_ids=[] if i else event.token_ids,
                logprobs=None if i else event.logprobs, finish_reason=finish if last else None,
                stop_reason=event.stop_reason if last else None))
        return events

    def resume(self, continuation: bus.Continuation, decode: Callable[[list[int]], str]) -> bool:
        """Brings each unfinished choice's parser to where a former owner left it, by reading again the text of
        the tokens it generated; False when what that gives differs from what its client already has."""
        for index, token_ids in enumerate(continuation.token_ids):
            if not token_ids or index >= len(continuation.finished) or continuation.finished[index]:
                continue
            parsed = self._choice(index).parse(decode(token_ids), finished=False)
            calls: list[bus.ToolCall] = []
            bus.add_call_deltas(calls, parsed.calls)
            sent_text = continuation.texts[index] if index < len(continuation.texts) else ""
            sent_calls = continuation.calls[index] if index < len(continuation.calls) else []
            if parsed.text != sent_text or calls != sent_calls:
                return False
        return True


def for_job(job: bus.Job, fmt: ToolFormat) -> JobOutput | None:
    """The parsers a job needs; None when its text goes out as it is."""
    use = job.tool_use
    if job.kind != "chat" or use is None or use.choice == "none":
        return None
    if use.choice == "function":
        name = use.name
        return JobOutput(job.id, lambda ids: NamedParser(name, ids))
    if use.choice == "required":
        return JobOutput(job.id, JsonParser)
    return JobOutput(job.id, fmt.parser, max_calls=None if use.parallel else 1)
