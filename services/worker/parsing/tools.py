"""Tool parsers: a choice's text in, content and tool-call deltas out, as the text arrives.

Every parser keeps back only what may still turn out to be part of a call (a partial `<tool_call>`, an
object whose name is not written yet) or whitespace next to one, and what it has put out depends only on
the text read so far: fed in one piece or in a thousand, the same content and the same calls come out.
A call is passed on as soon as its name is known (its first delta: index, id, name), then its arguments
as they are written. Text that looked like a call but is none goes out as content, unchanged.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from services.worker.parsing.scan import CallScanner
from shared.protocol import bus

CallIds = Callable[[int], str]
"""The id of a choice's call number n (the same on every worker, so that a continued job keeps its ids)."""


@dataclass
class Parsed:
    """What a piece of a choice's text became: content and call deltas, in the order they were written."""

    pieces: list[str | bus.ToolCallDelta] = field(default_factory=list)

    def add_text(self, text: str) -> None:
        if text:
            self.pieces.append(text)

    def add_call(self, delta: bus.ToolCallDelta) -> None:
        self.pieces.append(delta)

    def extend(self, other: Parsed) -> None:
        self.pieces.extend(other.pieces)

    @property
    def text(self) -> str:
        return "".join(piece for piece in self.pieces if isinstance(piece, str))

    @property
    def calls(self) -> list[bus.ToolCallDelta]:
        return [piece for piece in self.pieces if not isinstance(piece, str)]

    def runs(self) -> list[tuple[str, list[bus.ToolCallDelta]]]:
        """The pieces as (content, then calls) runs: a new run starts where content follows a call."""
        runs: list[tuple[list[str], list[bus.ToolCallDelta]]] = [([], [])]
        for piece in self.pieces:
            if isinstance(piece, str):
                if runs[-1][1]:
                    runs.append(([], []))
                runs[-1][0].append(piece)
            else:
                runs[-1][1].append(piece)
        return [("".join(texts), calls) for texts, calls in runs]


class ToolParser(Protocol):
    """One choice's parser: `feed` each piece of text, then `finish` once when the choice ends."""

    def feed(self, text: str) -> Parsed: ...

    def finish(self) -> Parsed: ...


class _Calls:
    """Numbers a choice's calls and turns a scanner's progress into deltas."""

    def __init__(self, call_id: CallIds) -> None:
        self.call_id = call_id
        self.count = 0
        """Calls closed so far."""
        self.open = False
        """The current call's first delta went out."""
        self.wrote = False
        """Some of the current call's arguments went out."""

    def progress(self, scanner: CallScanner, out: Parsed) -> None:
        if not self.open and scanner.name is not None:
            out.add_call(bus.ToolCallDelta(index=self.count, id=self.call_id(self.count), name=scanner.name))
            self.open = True
        if self.open and (arguments := scanner.take_arguments()):
            out.add_call(bus.ToolCallDelta(index=self.count, arguments=arguments))
            self.wrote = True

    def close(self, out: Parsed) -> None:
        """Ends the current call; one whose arguments never came takes none (`{}`), so they still parse."""
        if self.open:
            if not self.wrote:
                out.add_call(bus.ToolCallDelta(index=self.count, arguments="{}"))
            self.count += 1
            self.open = self.wrote = False

    @property
    def made(self) -> bool:
        return self.count > 0 or self.open


def partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the beginning of `marker`."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)


MAX_HELD_WHITESPACE = 256
"""The most whitespace a parser keeps back (or drops) at once: before a tag, around the calls, at the end. Of a
longer run the rest goes on as text; kept whole, a run the model writes token by token (a tenant can ask for
one) was copied and scanned again with each token, quadratic in its length on the worker's loop."""


def trailing_space(text: str) -> int:
    """How much of the whitespace at the end of `text` a parser may keep back (or drop): MAX_HELD_WHITESPACE of
    it at most."""
    return min(len(text) - len(text.rstrip()), MAX_HELD_WHITESPACE)


def without_trailing_space(text: str) -> str:
    """`text` less the whitespace at its end that a parser drops (see trailing_space)."""
    return text[: len(text) - trailing_space(text)]


def leading_space_bounded(text: str) -> str:
    """`text` with at most MAX_HELD_WHITESPACE of the whitespace at its start (the rest is dropped)."""
    space = len(text) - len(text.lstrip())
    return text[space - MAX_HELD_WHITESPACE:] if space > MAX_HELD_WHITESPACE else text


def held_tail(text: str, marker: str) -> int:
    """How many characters at the end of `text` to keep back: a beginning of `marker`, and the whitespace
    before it (dropped if the marker follows; MAX_HELD_WHITESPACE of it at most)."""
    partial = partial_marker(text, marker)
    return partial + trailing_space(text[: len(text) - partial])


class _Mode(enum.Enum):
    TEXT = "text"
    CALL = "call"
    AFTER_CALL = "after call"


class TaggedParser:
    """Calls as JSON objects between tags, anywhere in the text (Hermes, Qwen 2.5 and 3, many others):
    `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`. A missing closing tag at the end is forgiven."""

    def __init__(self, call_id: CallIds, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>") -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self.calls = _Calls(call_id)
        self.mode = _Mode.TEXT
        self.pending = ""
        self.scanner = CallScanner()
        self.gap = ""
        """The opening tag and the whitespace before it: content after all if no call follows."""

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self.pending += text
        while self._advance(out):
            pass
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self.mode is _Mode.TEXT:
            out.add_text(without_trailing_space(self.pending) if self.calls.made else self.pending)
        elif self.mode is _Mode.CALL and not self.calls.open:
            out.add_text(self.gap + "".join(self.scanner.raw) + self.pending)
        self.calls.close(out)
        self.pending = ""
        return out

    def _advance(self, out: Parsed) -> bool:
        if self.mode is _Mode.TEXT:
            return self._text(out)
        if self.mode is _Mode.CALL:
            return self._call(out)
        return self._after_call()

    def _text(self, out: Parsed) -> bool:
        start = self.pending.find(self.open_tag)
        if start >= 0:
            before = without_trailing_space(self.pending[:start])
            out.add_text(before)
            self.gap = self.pending[len(before):start] + self.open_tag
            self.pending = self.pending[start + len(self.open_tag):]
            self.mode, self.scanner = _Mode.CALL, CallScanner()
            return True
        keep = held_tail(self.pending, self.open_tag)
        out.add_text(self.pending[: len(self.pending) - keep])
        self.pending = self.pending[len(self.pending) - keep:]
        return False

    def _call(self, out: Parsed) -> bool:
        scanner = self.scanner
        self.pending = self.pending[scanner.feed(self.pending):]
        self.calls.progress(scanner, out)
        if scanner.done and scanner.name is not None:
            self.calls.close(out)
            self.mode = _Mode.AFTER_CALL
        elif scanner.failed or scanner.done:  # no call after all (or one whose end is garbled)
            if not self.calls.open:
                out.add_text(self.gap + "".join(scanner.raw))
            self.calls.close(out)
            self.mode = _Mode.TEXT
        else:
            return False
        return True

    def _after_call(self) -> bool:
        self.pending = leading_space_bounded(self.pending)
        rest = self.pending.lstrip()
        if rest.startswith(self.close_tag):
            self.pending = rest[len(self.close_tag):]
        elif self.close_tag.startswith(rest):
            return False  # (a beginning of) the closing tag, or only whitespace so far
        self.mode = _Mode.TEXT
        return True


class _Json(enum.Enum):
    START = "start"
    ARRAY_ITEM = "array item"
    ARRAY_AFTER = "after array item"
    OBJECTS_AFTER = "after object"
    OBJECTS_ITEM = "next object"
    CALL = "call"
    TEXT = "text"


class JsonParser:
    """Calls as plain JSON at the start of the answer (Llama 3.x, Mistral-style, and what a `required` tool
    choice forces): one `{"name", "arguments"}` object, several separated by whitespace, `,` or `;`, or a
    JSON array of them. An answer that does not begin with `{` or `[` is content; text after the calls too."""

    def __init__(self, call_id: CallIds) -> None:
        self.calls = _Calls(call_id)
        self.state = _Json.START
        self.pending = ""
        self.region: list[str] = []
        """The JSON read so far: content after all if it holds no call."""
        self.scanner = CallScanner()
        self.in_array = False
        self.text_after = False
        """Text after the calls has begun (its leading whitespace is behind)."""

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self.pending += text
        while self.pending and self._advance(out):
            pass
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self.state is _Json.TEXT:
            out.add_text(without_trailing_space(self.pending) if self.calls.made else self.pending)
        elif not self.calls.made:
            out.add_text("".join(self.region) + self.pending)
        elif self.state is _Json.CALL and not self.calls.open:
            out.add_text("".join(self.scanner.raw))
        self.calls.close(out)
        self.pending = ""
        return out

    def _advance(self, out: Parsed) -> bool:
        if self.state is _Json.CALL:
            return self._call(out)
        if self.state is _Json.TEXT:
            return self._text(out)
        rest = self.pending.lstrip()
        if not rest:  # whitespace: wait for what follows (it goes where whitespace between calls goes)
            if len(self.pending) > MAX_HELD_WHITESPACE:
                self._consume(len(self.pending) - MAX_HELD_WHITESPACE)
            return False
        self._consume(len(self.pending) - len(rest))
        return self._punctuation(rest[0], out)

    def _consume(self, n: int) -> None:
        self.region.append(self.pending[:n])
        self.pending = self.pending[n:]

    def _punctuation(self, c: str, out: Parsed) -> bool:
        """The character after the whitespace, between the calls."""
        state = self.state
        if c == "{" and state in (_Json.START, _Json.ARRAY_ITEM, _Json.OBJECTS_AFTER, _Json.OBJECTS_ITEM):
            self.state, self.scanner = _Json.CALL, CallScanner()
            self.in_array = self.in_array or state is _Json.ARRAY_ITEM
            return True
        if (state, c) in _MOVES:
            self._consume(1)
            self.state = _MOVES[state, c]
            self.in_array = self.in_array or c == "["
            return True
        return self._no_more_calls(out)

    def _call(self, out: Parsed) -> bool:
        scanner = self.scanner
        consumed = scanner.feed(self.pending)
        self._consume(consumed)
        self.calls.progress(scanner, out)
        if scanner.done and scanner.name is not None:
            self.calls.close(out)
            self.state = _Json.ARRAY_AFTER if self.in_array else _Json.OBJECTS_AFTER
            return True
        if scanner.failed or scanner.done:
            if self.calls.made and not self.calls.open:
                out.add_text("".join(scanner.raw))
            self.calls.close(out)
            return self._no_more_calls(out)
        return False

    def _no_more_calls(self, out: Parsed) -> bool:
        """What follows is content: all of it, what came before included, if no call was made."""
        if not self.calls.made:
            out.add_text("".join(self.region))
        self.region.clear()
        self.state = _Json.TEXT
        return True

    def _text(self, out: Parsed) -> bool:
        keep = 0
        if self.calls.made:  # the whitespace between the calls and any text after them is dropped
            if not self.text_after:
                self.pending = self.pending.lstrip()
                self.text_after = bool(self.pending)
            keep = trailing_space(self.pending)
        out.add_text(self.pending[: len(self.pending) - keep])
        self.pending = self.pending[len(self.pending) - keep:]
        return False


_MOVES = {
    (_Json.START, "["): _Json.ARRAY_ITEM,
    (_Json.ARRAY_AFTER, ","): _Json.ARRAY_ITEM,
    (_Json.ARRAY_AFTER, "]"): _Json.TEXT,
    (_Json.ARRAY_ITEM, "]"): _Json.TEXT,
    (_Json.OBJECTS_AFTER, ","): _Json.OBJECTS_ITEM,
    (_Json.OBJECTS_AFTER, ";"): _Json.OBJECTS_ITEM,
}
"""Between the calls: the punctuation that leads on, and where it leads."""


class NamedParser:
    """A call of one function forced by a constraint: the whole answer is its arguments."""

    def __init__(self, name: str, call_id: CallIds) -> None:
        self.name = name
        self.call_id = call_id
        self.started = False
        self.wrote = False
        self.pending = ""

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        if not self.started:
            self.started = True
            out.add_call(bus.ToolCallDelta(index=0, id=self.call_id(0), name=self.name))
        self.pending += text
        if not self.wrote:
            self.pending = self.pending.lstrip()
        body = without_trailing_space(self.pending)
        if body:
            out.add_call(bus.ToolCallDelta(index=0, arguments=body))
            self.wrote = True
            self.pending = self.pending[len(body):]
        return out

    def finish(self) -> Parsed:
        out = self.feed("")
        if not self.wrote:
            out.add_call(bus.ToolCallDelta(index=0, arguments="{}"))
        return out
