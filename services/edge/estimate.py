"""What a job may cost in tokens, known before anything is tokenized: the edge has no tokenizer, and admission
must charge a request before the worker expands it.

Text is counted in UTF-8 bytes. ASCII text (English, code) runs about four bytes a token with the BPE
tokenizers of today's models; any other byte counts as a token of its own. A byte-level BPE (and a
SentencePiece with byte fallback) never makes more tokens than bytes, so CJK text and emoji are reserved at
their worst case rather than at a quarter of a token a character. The reservation is settled with the real
count when the job ends.
"""

from __future__ import annotations

import msgspec

from shared.protocol import bus
from shared.protocol.errors import ContextLengthExceeded, InvalidRequest

ASCII_BYTES_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
"""What a chat template adds around each message, roughly."""
MAX_BUDGET = 2**31 - 1
"""A choice's budget when the model's context is unknown: a count the bus carries whatever multiplies it."""


def text_tokens(text: str) -> int:
    """The most tokens `text` is likely to take: ASCII bytes by four, every other byte as one."""
    if text.isascii():
        return -(-len(text) // ASCII_BYTES_PER_TOKEN)
    ascii_bytes = len(text.encode("ascii", "ignore"))
    return -(-ascii_bytes // ASCII_BYTES_PER_TOKEN) + len(text.encode()) - ascii_bytes


def estimate(job: bus.Job, max_model_len: int) -> tuple[int, int]:
    """(prompt tokens, output budget) of a job, before anything is tokenized."""
    framing = TOKENS_PER_MESSAGE * len(job.messages)
    instruction = text_tokens(job.instruction) if job.instruction else 0
    per_prompt = ([len(ids) for ids in job.prompt_ids] if job.prompt_ids  # token ids: counted exactly
                  else [text_tokens(p) + instruction for p in job.prompts]) or [0]
    read = [per_prompt[a] + per_prompt[b] for a, b in job.pairs] if job.pairs else per_prompt  # a pair reads both
    prompt = (sum(map(_message_tokens, job.messages)) + sum(read) + _tools_tokens(job.tool_use)
              + framing)
    if job.kind == "embedding":
        return prompt, 0
    per_choice = job.params.max_tokens
    if per_choice is None:
        per_choice = max(1, max_model_len - max(per_prompt) - framing) if max_model_len else 0
    per_choice = min(per_choice, max_model_len or MAX_BUDGET)  # no choice outruns the context
    return prompt, per_choice * job.params.n * max(1, len(job.prompts))


def _message_tokens(message: bus.Message) -> int:
    """Every text of the message a chat template may render: its content, the reasoning an assistant's shows
    again, its calls, the id of the call a tool message answers."""
    return (text_tokens(message.content) + text_tokens(message.reasoning) + text_tokens(message.tool_call_id)
            + sum(text_tokens(c.id) + text_tokens(c.name) + text_tokens(c.arguments) for c in message.tool_calls))


def _tools_tokens(use: bus.ToolUse | None) -> int:
    """The functions the template lists in the prompt, as JSON."""
    if use is None or use.choice == "none":
        return 0
    return text_tokens(msgspec.json.encode(use.tools).decode())


def check_prompt_fits(job: bus.Job, max_model_len: int, route: str = "") -> None:
    """Refuses a prompt that cannot fit the model's context whatever its tokenizer (more characters than
    max_model_len tokens of bus.MAX_TOKEN_CHARS each): the worker would tokenize megabytes, on the one thread every
    request's prompt waits for, only to find so. A conversation that truncates is held to what truncation keeps
    (its system messages and its last turn); a plain prompt that truncates, to nothing. 0: the context is not known
    yet."""
    if not max_model_len or job.keep_last_tokens or (job.truncate and not job.messages):
        return
    most = max_model_len * bus.MAX_TOKEN_CHARS
    if job.messages:
        messages = _never_dropped(job.messages) if job.truncate else job.messages
        chars = sum(len(m.content) + len(m.reasoning) + sum(len(c.arguments) for c in m.tool_calls)
                    for m in messages)
        param = "input" if route == "responses" else "messages"
    else:
        chars = max((len(prompt) for prompt in job.prompts), default=0) + len(job.instruction)
        param = "input" if job.kind == "embedding" else "prompt"
    if chars > most:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens; the prompt's {chars} characters "
            f"cannot fit it (no token spells more than {bus.MAX_TOKEN_CHARS}).", param=param)


STOP_FIELDS = {"tgi": "parameters.stop", "messages": "stop_sequences"}
"""Where a route's requests give their stop strings, by the plan's route (else `stop`)."""


def check_stops(job: bus.Job, most: int, route: str) -> None:
    """Refuses more stop strings than --max-stop-sequences: each costs the worker a check on every token."""
    if len(job.params.stop) > most:
        raise InvalidRequest(f"At most {most} stop sequences are served; this request gives {len(job.params.stop)}.",
                             param=STOP_FIELDS.get(route, "stop"))


def _never_dropped(messages: list[bus.Message]) -> list[bus.Message]:
    """What truncation "auto" keeps of a conversation whatever its length: the system messages and the last turn."""
    turns = [m for m in messages if m.role != "system"]
    return [m for m in messages if m.role == "system"] + turns[-1:]
