"""A job's prompt prefix as placement sees it, the same in every process: a chain of hashes over its leading parts,
where link k names everything up to the end of part k. The parts are text, not tokens (the edge has no tokenizer):
the job's LoRA adapter, if any (an engine caches an adapter's prompts apart from its base model's, and the adapter's
jobs go where it is loaded), then the client's prompt_cache_key, if any (with its tenant), then a chat's tools, if
any, then each message in CHUNK_CHARS pieces, its last piece however short (so a long system prompt or document
shared by many requests gives them many links in common, and each message boundary one); a completion's first prompt
in whole CHUNK_CHARS pieces. Two jobs share link k exactly when they share parts 1..k and their cache salt (the
tenant, unless the prompt cache is shared), which seeds every link. See docs/cache-aware-dispatch.md."""

from __future__ import annotations

import hashlib

import msgspec

from shared.protocol import bus

MAX_LINKS = 64
"""The parts a chain names at most (a prompt's first 64 KiB or so: placement needs no more)."""
CHUNK_CHARS = 1024

_encode = msgspec.msgpack.Encoder().encode


def chain(job: bus.Job) -> list[str]:
    """The job's links, in order, each 16 hex digits; none for an embedding job or one that only counts its
    prompt (it fills no cache)."""
    if job.count_only:
        return []
    parts: list[bytes] = [b"adapter\0" + job.adapter.encode()] if job.adapter else []
    if job.cache_key:
        parts.append(b"key\0" + _encode([job.tenant, job.cache_key]))
    if job.kind == "chat":
        if job.tool_use is not None:
            parts.append(_encode(job.tool_use))
        for message in job.messages:
            # the text as it leads (an encoding with its length first would differ from the first byte on)
            leading = f"{message.role}\n{message.content}".encode()
            pieces = [leading[at:at + CHUNK_CHARS] for at in range(0, min(len(leading), CHUNK_CHARS * MAX_LINKS),
                                                                   CHUNK_CHARS)]
            pieces[-1] += b"\0" + _encode([message.tool_calls, message.tool_call_id, message.reasoning])
            parts += pieces
            if len(parts) >= MAX_LINKS:
                break
    elif job.kind == "completion" and job.prompts:
        # a prompt of token ids leads as its ids do (written out: the same ids, the same links)
        first = job.prompts[0] or ",".join(map(str, job.prompt_ids[0][:CHUNK_CHARS * MAX_LINKS] if job.prompt_ids
                                               else []))
        text = first[:CHUNK_CHARS * MAX_LINKS]
        parts += [text[at:at + CHUNK_CHARS].encode() for at in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS)]
    links: list[str] = []
    # the salt seeds every link rather than being one: it names no text, and a link of its own would send all its
    # tenant's jobs where one of them ran
    digest = hashlib.blake2b(b"salt\0" + job.cache_salt.encode(), digest_size=8).digest() if job.cache_salt else b""
    for part in parts[:MAX_LINKS]:
        digest = hashlib.blake2b(digest + part, digest_size=8).digest()
        links.append(digest.hex())
    return links
