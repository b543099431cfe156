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
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from services.worker.parsing.formats import ToolFormat, system_prompt
from shared.protocol import bus

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


MAX_RENDERS = 7
"""Full renders of a truncated conversation, the first included; past them it keeps the fitting one it has,
which may then drop a turn or a few more than needed."""
_GUESSES = 5
"""Renders, the first included, after which the next ones halve the range instead of following the estimate (one
that keeps missing, from a template whose turns do not add up, still ends within MAX_RENDERS)."""


def estimate_text(message: dict[str, Any]) -> str:
    """What a template writes of a message besides its framing: the text its size is estimated from."""
    calls = message.get("tool_calls")
    return message["content"] + message.get("reasoning", "") + (orjson.dumps(calls).decode() if calls else "")


def reachable(messages: list[dict[str, Any]], most_chars: int) -> list[dict[str, Any]] | None:
    """The conversation without the oldest turns no truncation could keep: with them, more than `most_chars`
    characters of text would remain, more tokens than the context holds whatever the tokenizer. None when even its
    system messages and last turn, which truncation keeps, are longer."""
    turns = [i for i, m in enumerate(messages) if m["role"] != "system"][:-1]
    chars = [len(estimate_text(m)) for m in messages]
    room = most_chars - sum(chars) + sum(chars[i] for i in turns)
    if room < 0:
        return None
    dropped = len(turns)  # the newest ones come back while they fit
    while dropped and chars[turns[dropped - 1]] <= room:
        dropped -= 1
        room -= chars[turns[dropped]]
    gone = set(turns[:dropped])
    return [m for i, m in enumerate(messages) if i not in gone]


class Truncation:
    """Truncation "auto": the fewest of the oldest turns to drop for the prompt to fit, in a few full renders.

    The turns that can go are every message but the system ones and the last of the others, oldest first, as
    when one was dropped per render. A template's turns add up (special tokens end each one): a render that
    drops `k` turns is estimated from a rendered one by the dropped turns' own tokens plus a per-turn framing
    measured between two renders, so a guess usually lands on the answer, and the next render confirms that
    one turn fewer would not fit.
    """

    def __init__(self, messages: list[dict[str, Any]], sizes: list[int], ids: list[int], limit: int) -> None:
        """`sizes`: each message's `estimate_text` in tokens; `ids`: the whole conversation rendered."""
        self.messages = messages
        self.order = [i for i, m in enumerate(messages) if m["role"] != "system"][:-1]
        self.dropped = [0]
        """Tokens of the first k droppable turns, k = 0 .. all (running totals)."""
        for i in self.order:
            self.dropped.append(self.dropped[-1] + sizes[i])
        self.limit = limit
        self.tokens: dict[int, int] = {}
        """Exact prompt tokens of the renders made, by turns dropped."""
        self.framing = max(0, len(ids) - sum(sizes)) / max(1, len(messages))
        """The first guess at a turn's tokens beyond its text: all that the render adds, spread over the turns."""
        self.fits_not = 0
        self.fits = len(self.order)
        """Turns dropped: the most known too long, the fewest known to fit (or all there are)."""
        self.ids: list[int] | None = None
        """The prompt with `fits` turns dropped, once rendered."""
        self.record(0, ids)

    async def run(self, render: Callable[[list[dict[str, Any]]], Awaitable[list[int]]]) -> list[int]:
        """The prompt's ids, rendering (and tokenizing) each conversation tried with `render`."""
        while (k := self.next()) is not None:
            self.record(k, await render(self.kept(k)))
        assert self.ids is not None  # nosec B101: an invariant (tokenbus never runs with -O); next() ends only once the answer is rendered
        return self.ids

    def kept(self, k: int) -> list[dict[str, Any]]:
        """The conversation without its first `k` droppable turns."""
        gone = set(self.order[:k])
        return [m for i, m in enumerate(self.messages) if i not in gone]

    def next(self) -> int | None:
        """How many turns to drop in the next render; None when `ids` is the answer."""
        spare = MAX_RENDERS - len(self.tokens) - (1 if self.ids is None else 0)  # the answer's render kept back
        if self.fits - self.fits_not <= 1 or spare <= 0:
            return self.fits if self.ids is None else None
        if len(self.tokens) > _GUESSES:  # the first render and the guesses
            return (self.fits_not + self.fits) // 2
        return self._guess()

    def record(self, k: int, ids: list[int]) -> None:
        """The render that dropped `k` turns."""
        self.tokens[k] = len(ids)
        if len(ids) <= self.limit or k == self.fits:
            self.fits, self.ids = k, ids
        else:
            self.fits_not = k

    def _guess(self) -> int:
        """The fewest turns whose estimated tokens bring the longest render known too long under the limit."""
        low, framing = self.fits_not, self._framing()
        excess = self.tokens[low] - self.limit
        k = low + 1
        while k < self.fits - 1 and self.dropped[k] - self.dropped[low] + framing * (k - low) < excess:
            k += 1
        return k

    def _framing(self) -> float:
        """Tokens a turn costs beyond its own text, from the two renders nearest the answer (or the first)."""
        low, high = self.fits_not, self.fits
        if high not in self.tokens:
            low, high = 0, self.fits_not
        if high == low:
            return self.framing
        return max(0.0, (self.tokens[low] - self.tokens[high] - (self.dropped[high] - self.dropped[low]))
                   / (high - low))
