"""The worker's grammar compiler: a helper process (shared.runtime.helpers) that compiles each constraint with
XGrammar as vLLM's engine will, so that the worker knows within a bound whether the engine can (see
services.worker.grammar_gate). `python -m services.worker.grammar_compile <progress fd> <threads>`: the engine's
vocabulary (XGrammar's serialized TokenizerInfo) on its first line in, then a `[kind, spec]` per line (kinds of
vllm_terms.compiled_spec), each answered with null (compiled) or XGrammar's refusal (which vLLM makes its own).

It imports xgrammar (and with it torch), not vLLM; it compiles on `threads` threads (grammar_gate.helper_threads)
and keeps nothing. A compile may take the pool's CPU time over all its threads (shared.runtime.helpers) and
MEMORY_BYTES beyond what the process started with (past them it fails and the process ends)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
from typing import Any

import orjson
import xgrammar as xgr

from shared.runtime import helpers

MEMORY_BYTES = 4 << 30
"""Address space a compile may add (the process is refused more, and ends)."""
OUT_OF_MEMORY = 3


def compile_spec(compiler: Any, kind: str, spec: str) -> None:
    """What vLLM's XgrammarBackend.compile_grammar does for these kinds (vLLM 0.32, its defaults: any whitespace)."""
    if kind == "json":
        compiler.compile_json_schema(spec, any_whitespace=True)
    elif kind == "regex":
        compiler.compile_regex(spec)
    elif kind == "grammar":
        compiler.compile_grammar(spec)
    elif kind == "structural_tag":
        tag = json.loads(spec)
        if isinstance(tag, dict) and "structures" in tag:  # the older form, as vLLM compiles it
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            compiler.compile_structural_tag(items, tag["triggers"])
        else:
            compiler.compile_structural_tag(spec)
    else:
        raise ValueError(f"unknown kind {kind!r}")


def _limit_memory() -> None:
    with open("/proc/self/statm", encoding="ascii") as statm:
        limit = int(statm.read().split()[0]) * resource.getpagesize() + MEMORY_BYTES
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def main() -> None:
    threads = int(sys.argv[2])
    vocabulary = xgr.TokenizerInfo.deserialize_json(sys.stdin.buffer.readline().decode())
    compiler = xgr.GrammarCompiler(vocabulary, max_threads=threads, cache_enabled=False)
    _limit_memory()

    def answer(line: bytes, progress: helpers.Progress) -> bytes:
        kind, spec = orjson.loads(line)
        try:
            compile_spec(compiler, kind, spec)
        except MemoryError:
            os._exit(OUT_OF_MEMORY)  # no answer: the worker refuses it, the engine never compiles it
        except Exception as exc:  # XGrammar's refusal, whatever it raises, is the answer
            if "bad_alloc" in str(exc):
                os._exit(OUT_OF_MEMORY)
            return orjson.dumps(str(exc)[:500])
        return b"null"

    helpers.serve(answer)


if __name__ == "__main__":
    main()
