"""Which `chat_template_kwargs` of a request reach the model's chat template: an allowlist made from the
template itself, as vLLM does (the variables the template reads), less what the server sets and the
tokenizer's special tokens (a client that redefines `eos_token` rewrites the prompt's framing). Others are
dropped, as vLLM drops them."""

from __future__ import annotations

from typing import Any

SERVER_SET = frozenset({"messages", "conversation", "tokenize", "add_generation_prompt", "continue_final_message",
                        "chat_template", "tools", "documents"})
SPECIAL_TOKEN_NAMES = frozenset({"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                                 "mask_token", "additional_special_tokens"})


def template_variables(template: Any) -> frozenset[str]:
    """The variables a chat template (its text, or a dict of named ones) reads and does not set itself."""
    import jinja2.meta
    import jinja2.sandbox

    if isinstance(template, dict):
        return frozenset().union(*(template_variables(t) for t in template.values()))
    if not isinstance(template, str):
        return frozenset()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        parsed = env.parse(template)
    except jinja2.TemplateSyntaxError:  # the template's own tags (e.g. {% generation %}): allow nothing extra
        return frozenset()
    return frozenset(jinja2.meta.find_undeclared_variables(parsed))


def allowed(template_vars: frozenset[str], given: dict[str, Any]) -> dict[str, Any]:
    """The kwargs of `given` the template may receive."""
    return {k: v for k, v in given.items()
            if k in template_vars and k not in SERVER_SET and k not in SPECIAL_TOKEN_NAMES}
