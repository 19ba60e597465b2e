"""Render the model's own chat template exactly as `transformers` does, and split it into per-role affixes.

The DSL appends role blocks one at a time (`s += user(...)`), so it needs, for the next message, the text
that goes before its content (prefix) and after it (suffix). We render the history plus a message whose
content is a sentinel and cut around the sentinel; this reproduces `tokenizer.apply_chat_template` for any
template that renders a conversation as the concatenation of its messages (ChatML, Llama 3, Mistral, Qwen,
SmolLM2 with its default system prompt, ...). Templates that rewrite earlier messages when later ones arrive
are reported with a clear error instead of silently producing a different prompt.

Environment settings mirror transformers' `_cached_compile_jinja_template`: sandboxed, `trim_blocks`,
`lstrip_blocks`, loop controls, `{% generation %}` blocks, `raise_exception`, `strftime_now`, and a `tojson`
filter that does not HTML-escape.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lang.errors import ProgramError

_SENTINEL = "\x00radixlm-content\x00"


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (used by some templates to mark assistant text):
    render the body.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class ChatTemplate:
    """A model's chat template plus the special-token strings (`bos_token`, `eos_token`, ...) it may use."""

    def __init__(self, template: str | None, special_tokens: dict[str, str] | None = None) -> None:
        self.template = template
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_model_info(cls, info: dict[str, Any]) -> ChatTemplate:
        """Build from a `GET /get_model_info` body: `chat_template` plus every `*_token` string field."""
        tokens = {k: v for k, v in info.items() if k.endswith("_token") and isinstance(v, str)}
        return cls(info.get("chat_template"), tokens)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """Same string as `tokenizer.apply_chat_template(messages, tokenize=False, ...)`."""
        if not self.template:
            raise ProgramError(
                "the model has no chat template, so role blocks (system/user/assistant) cannot be used"
            )
        try:
            return _compile(self.template).render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ProgramError(f"the model's chat template rejected the conversation: {e}") from e

    def role_affixes(self, history: list[dict[str, Any]], role: str) -> tuple[str, str]:
        """(prefix, suffix) around the content of a new `role` message that follows `history`.

        Invariant: render(history) + prefix + content + suffix == render(history + [{role, content}]) for
        templates that render messages independently of what follows them.
        """
        before = self.render(history) if history else ""
        full = self.render([*history, {"role": role, "content": _SENTINEL}])
        at = full.find(_SENTINEL, len(before))
        if not full.startswith(before) or at < 0:
            raise ProgramError(
                f"the model's chat template does not render a {role!r} message "
                f"after {len(history)} message(s) "
                "as an appendable block (it rewrites earlier text or drops the content); "
                "use plain text instead"
            )
        return full[len(before) : at], full[at + len(_SENTINEL) :]

    @staticmethod
    def end_token(suffix: str) -> str | None:
        """The role's end marker (e.g. `<|im_end|>`): the suffix without surrounding whitespace, if any."""
        token = suffix.strip()
        return token or None


# A neutral template for backends that take messages rather than text (OpenAI): it only makes `state.text()`
# readable; the backend itself never sees this rendering.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
