"""Reasoning parsers: a choice's text in, its reasoning and its answer apart, as the text arrives.

Models that think write their reasoning in a block before the answer: `<think>reasoning</think>answer`.
Some write the opening tag themselves (Qwen3, `qwen3`); for others the chat template has already opened the
block in the prompt, so the text starts inside it and only the closing tag shows (DeepSeek-R1, `deepseek_r1`).
A choice that ends before the block closes is all reasoning (it ran out of tokens while thinking).

As with the tool parsers, what comes out depends only on the text read so far, never on how it was cut: a
parser keeps back only what may still be the start of a tag, and the whitespace between the block and the
answer (dropped). Text that does not open with the block, when the model writes the tag itself, is all
answer: a model that does not think (or was told not to) serves as it would without a parser.

Open for more: `register(ReasoningFormat(name, factory))` with a parser of the `ReasoningParser` shape.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from services.worker.parsing.tools import held_tail, leading_space_bounded, without_trailing_space


@dataclass
class Split:
    """What a piece of a choice's text became."""

    reasoning: str = ""
    content: str = ""

    def extend(self, other: Split) -> None:
        self.reasoning += other.reasoning
        self.content += other.content


class ReasoningParser(Protocol):
    """One choice's parser: `feed` each piece of text, then `finish` once when the choice ends."""

    def feed(self, text: str) -> Split: ...

    def finish(self) -> Split: ...

    @property
    def thinking(self) -> bool:
        """Whether the text read so far ends inside the reasoning."""
        ...

    @property
    def deciding(self) -> bool:
        """Whether the text read so far does not yet tell if it opens the reasoning."""
        ...


class _Where(enum.Enum):
    START = "before the block"
    OPENED = "in the block, before the reasoning"
    REASONING = "in the block"
    BETWEEN = "after the block, before the answer"
    ANSWER = "in the answer"


class ThinkParser:
    """`<think>...</think>` then the answer; `opened`: the template opened the block, the text starts in it
    (an opening tag the model writes anyway is dropped)."""

    def __init__(self, opened: bool = False, open_tag: str = "<think>", close_tag: str = "</think>") -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self.opened = opened
        self.where = _Where.START
        self.held = ""

    @property
    def thinking(self) -> bool:
        return self.where in (_Where.OPENED, _Where.REASONING)

    @property
    def deciding(self) -> bool:
        return self.where is _Where.START

    def feed(self, text: str) -> Split:
        out = Split()
        text = self.held + text
        self.held = ""
        while text:
            text = self._step(text, out)
        return out

    def finish(self) -> Split:
        """What was kept back: a partial tag at the start is answer (or, inside the block, reasoning)."""
        held, self.held = self.held, ""
        if self.where is _Where.START:
            return Split(reasoning=held) if self.opened else Split(content=held)
        if self.where is _Where.REASONING:
            return Split(reasoning=without_trailing_space(held))
        return Split()  # only whitespace around a block or an answer that never came

    def _step(self, text: str, out: Split) -> str:
        """Consumes some of the text (or keeps it back); returns the rest."""
        if self.where is _Where.START:
            return self._start(text, out)
        if self.where is _Where.OPENED:
            return self._skip_space(text, _Where.REASONING)
        if self.where is _Where.REASONING:
            end = text.find(self.close_tag)
            if end < 0:
                keep = held_tail(text, self.close_tag)
                out.reasoning += text[: len(text) - keep]
                self.held = text[len(text) - keep:]
                return ""
            out.reasoning += without_trailing_space(text[:end])
            self.where = _Where.BETWEEN
            return text[end + len(self.close_tag):]
        if self.where is _Where.BETWEEN:
            return self._skip_space(text, _Where.ANSWER)
        out.content += text
        return ""

    def _skip_space(self, text: str, then: _Where) -> str:
        rest = text.lstrip()
        if rest:
            self.where = then
        return rest

    def _start(self, text: str, out: Split) -> str:
        text = leading_space_bounded(text)
        stripped = text.lstrip()
        if stripped.startswith(self.open_tag):
            self.where = _Where.OPENED
            return stripped[len(self.open_tag):]
        if self.open_tag.startswith(stripped):  # nothing yet, or a beginning of the tag: wait for more
            self.held = text
            return ""
        self.where = _Where.OPENED if self.opened else _Where.ANSWER
        return text


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    make: Callable[[], ReasoningParser]
    starts_inside: bool = False
    """The template opens the block: the text starts as reasoning. Such a parser does not read an answer held
    to a constraint from its first token (JSON, a regex), which would all look like reasoning; one whose
    model opens the block itself lets the text decide."""


REASONING_FORMATS: dict[str, ReasoningFormat] = {}


def register(fmt: ReasoningFormat) -> None:
    REASONING_FORMATS[fmt.name] = fmt


def reasoning_format(name: str) -> ReasoningFormat | None:
    """The format of that name (None for "" or none); a ValueError naming the known ones otherwise."""
    if name in ("", "none"):
        return None
    if name not in REASONING_FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}: choose one of none, "
                         f"{', '.join(sorted(REASONING_FORMATS))}")
    return REASONING_FORMATS[name]


register(ReasoningFormat("qwen3", ThinkParser))
register(ReasoningFormat("deepseek_r1", lambda: ThinkParser(opened=True), starts_inside=True))
