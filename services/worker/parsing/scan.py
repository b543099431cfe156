"""One JSON object read a character at a time as a tool call: `{"name": "f", "arguments": {...}}`.

The name is known as soon as its string closes, and the arguments (an object, or a JSON string holding one)
can be passed on while they are written. The scanner checks the object's shape (keys, colons, commas,
strings, nesting), not the values inside the arguments: it hands on what the model wrote.
"""

from __future__ import annotations

import enum

import orjson

WHITESPACE = frozenset(" \t\n\r")
NAME_KEY = "name"
ARGUMENT_KEYS = ("arguments", "parameters")
"""Models write one or the other (Hermes and Qwen `arguments`, Llama 3 `parameters`)."""
NO_ARGUMENTS = "{}"


class _State(enum.Enum):
    START = "start"
    KEY_OR_END = "key or end"
    KEY_NEXT = "key"
    KEY = "in key"
    COLON = "colon"
    VALUE = "value"
    STRING = "in string"
    NESTED = "in object or array"
    LITERAL = "in literal"
    AFTER = "after value"
    DONE = "done"
    FAILED = "failed"


_SKIPS_WHITESPACE = frozenset({_State.START, _State.KEY_OR_END, _State.KEY_NEXT, _State.COLON, _State.VALUE,
                               _State.AFTER})


class _Target(enum.Enum):
    """Where the characters of the current value go."""

    SKIP = "skip"
    NAME = "name"
    ARGUMENTS = "arguments"
    ARGUMENTS_STRING = "arguments as a JSON string"


class CallScanner:
    """Feed it text; it stops at the end of the object (`done`) or at the first character that cannot
    belong to a call object (`failed`), and says how much it consumed."""

    def __init__(self) -> None:
        self.raw: list[str] = []
        """Everything consumed, handed back as plain text by a parser when this was no call after all."""
        self.name: str | None = None
        self.has_arguments = False
        self._pending: list[str] = []
        self._state = _State.START
        self._target = _Target.SKIP
        self._key: list[str] = []
        self._value: list[str] = []
        self._depth = 0
        self._in_string = False
        self._escape = False

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    @property
    def failed(self) -> bool:
        return self._state is _State.FAILED

    def feed(self, text: str) -> int:
        """Consumes text up to the end of the object or a failure; returns how many characters it took."""
        i = 0
        while i < len(text) and self._state not in (_State.DONE, _State.FAILED):
            if self._step(text[i]):
                i += 1
        self.raw.append(text[:i])
        return i

    def take_arguments(self) -> str:
        """The argument text read since the last call (a fragment of the JSON text)."""
        taken = "".join(self._pending)
        self._pending.clear()
        return taken

    # one character: True when it was consumed (a literal's end is read again by the next state)

    def _step(self, c: str) -> bool:
        state = self._state
        if state in _SKIPS_WHITESPACE and c in WHITESPACE:
            return True
        return _STEPS[state](self, c)

    def _start(self, c: str) -> bool:
        return self._expect(c == "{", _State.KEY_OR_END)

    def _key_or_end(self, c: str) -> bool:
        if c == "}":
            return self._end()
        return self._key_start(c)

    def _key_start(self, c: str) -> bool:
        self._key.clear()
        return self._expect(c == '"', _State.KEY)

    def _colon(self, c: str) -> bool:
        return self._expect(c == ":", _State.VALUE)

    def _expect(self, ok: bool, then: _State) -> bool:
        self._state = then if ok else _State.FAILED
        return ok

    def _key_char(self, c: str) -> bool:
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            self._state = _State.COLON
            return True
        self._key.append(c)
        return True

    def _choose_target(self, c: str) -> _Target | None:
        """Where the value that starts with `c` goes; None when it cannot be a call's value."""
        key = _decoded('"' + "".join(self._key) + '"')
        if key == NAME_KEY and self.name is None:
            return _Target.NAME if c == '"' else None
        if key in ARGUMENT_KEYS and not self.has_arguments:
            self.has_arguments = True
            return _Target.ARGUMENTS_STRING if c == '"' else _Target.ARGUMENTS
        return _Target.SKIP

    def _value_start(self, c: str) -> bool:
        target = self._choose_target(c)
        if target is None:
            return self._expect(False, _State.FAILED)
        self._target = target
        self._value.clear()
        if c == '"':
            self._state = _State.STRING
        elif c in "{[":
            self._state, self._depth, self._in_string = _State.NESTED, 1, False
        else:
            self._state = _State.LITERAL
        self._keep(c)
        return True

    def _keep(self, c: str) -> None:
        if self._target is _Target.ARGUMENTS:
            self._pending.append(c)
        elif self._target is not _Target.SKIP:
            self._value.append(c)

    def _string_char(self, c: str) -> bool:
        self._keep(c)
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            return self._value_end()
        return True

    def _nested_char(self, c: str) -> bool:
        self._keep(c)
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
        elif c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 0:
                return self._value_end()
        return True

    def _literal_char(self, c: str) -> bool:
        if c in WHITESPACE or c in ",}":
            self._state = _State.AFTER
            return False
        self._keep(c)
        return True

    def _value_end(self) -> bool:
        if self._target in (_Target.NAME, _Target.ARGUMENTS_STRING):
            decoded = _decoded("".join(self._value))
            if not isinstance(decoded, str):
                return self._expect(False, _State.FAILED)
            if self._target is _Target.NAME:
                self.name = decoded
            else:
                self._pending.append(decoded)
        self._state = _State.AFTER
        return True

    def _after_value(self, c: str) -> bool:
        if c == ",":
            return self._expect(True, _State.KEY_NEXT)
        if c == "}":
            return self._end()
        return self._expect(False, _State.FAILED)

    def _end(self) -> bool:
        if self.name is not None and not self.has_arguments:
            self._pending.append(NO_ARGUMENTS)
        self._state = _State.DONE
        return True


_STEPS = {
    _State.START: CallScanner._start,
    _State.KEY_OR_END: CallScanner._key_or_end,
    _State.KEY_NEXT: CallScanner._key_start,
    _State.KEY: CallScanner._key_char,
    _State.COLON: CallScanner._colon,
    _State.VALUE: CallScanner._value_start,
    _State.STRING: CallScanner._string_char,
    _State.NESTED: CallScanner._nested_char,
    _State.LITERAL: CallScanner._literal_char,
    _State.AFTER: CallScanner._after_value,
}


def _decoded(text: str) -> object:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
