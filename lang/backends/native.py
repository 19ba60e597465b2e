"""Program execution over radixlm's native `/generate` protocol, shared by the HTTP and in-process backends.

Subclasses only move request dicts (`request`, `request_stream`, `model_info`); everything about how the DSL
uses the protocol lives here.

`select` prefills the shared prompt once (`max_new_tokens: 0`), then scores every choice in one batch request
with `return_logprob` from just before the prompt's end, so only a few tokens per choice are recomputed (the
prompt is a radix-cache hit). A choice's tokens are those of tokenize(prompt + choice) from the first position
where they differ from tokenize(prompt); its score is their mean logprob. Starting exactly at the prompt's
length would break when the choice merges with the prompt's last token (a prompt ending in a space followed
by "yes" tokenizes as "... ␣yes"): then prompt+choice has no position past the prompt, and the server rejects
the request. So the batch starts BOUNDARY_TOKENS earlier and carries the bare prompt too, whose token ids
tell where each choice diverges.
"""

from __future__ import annotations

import math
import threading
from abc import abstractmethod
from collections.abc import Iterator
from typing import Any

from lang.backends.base import Backend, GenResult, Prompt, SelectResult, pick, request_options
from lang.chat_template import ChatTemplate
from lang.errors import BackendError

PREFILL_ONLY = {"max_new_tokens": 0}
# Prompt positions re-scored with each choice, to catch choices that merge with the prompt's last token(s).
BOUNDARY_TOKENS = 2


class NativeBackend(Backend):
    """`options`: per-request options (`base.REQUEST_OPTIONS`: a session, a cache salt, a deadline, a
    priority) sent with every request of the programs this backend runs. `lora`: the LoRA adapter they run
    under (sent as the native `lora_path`; None: the base model)."""

    def __init__(self, options: dict[str, Any] | None = None, lora: str | None = None) -> None:
        self._template: ChatTemplate | None = None
        self._lock = threading.Lock()
        self.options = request_options(options)
        if lora is not None and (not isinstance(lora, str) or not lora):
            raise ValueError(f"lora must be an adapter's name, got {lora!r}")
        self.lora = lora

    def _body(
        self, text: str | list[str], sampling: dict[str, Any], program_id: str | None = None, **extra: Any
    ) -> dict[str, Any]:
        own = {"program_id": program_id} if program_id and "program_id" not in self.options else {}
        if self.lora is not None:
            own["lora_path"] = self.lora
        return {**self.options, **own, "text": text, "sampling_params": sampling, **extra}

    # ---------------------------------------------------------------------------------------------- transport
    @abstractmethod
    def request(self, body: dict[str, Any]) -> Any:
        """POST /generate; returns the response dict (a list of dicts for list input). Raises BackendError."""

    @abstractmethod
    def request_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST /generate with stream=true; yields chunks whose "text" is cumulative. Raises BackendError."""

    @abstractmethod
    def model_info(self) -> dict[str, Any]:
        """GET /get_model_info."""

    # ---------------------------------------------------------------------------------------------- Backend
    def chat_template(self) -> ChatTemplate:
        with self._lock:
            if self._template is None:
                self._template = ChatTemplate.from_model_info(self.model_info())
            return self._template

    def generate(self, prompt: Prompt, sampling: dict[str, Any]) -> GenResult:
        out = self.request(self._body(prompt.text, sampling, prompt.program_id))
        return GenResult(_field(out, "text"), out.get("meta_info", {}))

    def generate_stream(self, prompt: Prompt, sampling: dict[str, Any]) -> Iterator[GenResult]:
        for chunk in self.request_stream(self._body(prompt.text, sampling, prompt.program_id, stream=True)):
            yield GenResult(_field(chunk, "text"), chunk.get("meta_info", {}))

    def cache_prefix(self, prompt: Prompt) -> None:
        if prompt.text:
            self.request(self._body(prompt.text, PREFILL_ONLY, prompt.program_id))

    def select(self, prompt: Prompt, choices: list[str]) -> SelectResult:
        if not choices:
            raise ValueError("select needs at least one choice")
        head = self.request(self._body(prompt.text, PREFILL_ONLY, prompt.program_id))
        n_prompt = int(_field(head.get("meta_info", {}), "prompt_tokens"))
        if n_prompt < 1:
            raise ValueError("select needs prompt text before it")
        start = max(n_prompt - BOUNDARY_TOKENS, 0)
        texts = [prompt.text] + [prompt.text + c for c in choices]
        outs = self.request(
            self._body(texts, PREFILL_ONLY, prompt.program_id, return_logprob=True, logprob_start_len=start)
        )
        if not isinstance(outs, list) or len(outs) != len(texts):
            raise BackendError(f"expected {len(texts)} results for a batch request, got {str(outs)[:200]}")
        prompt_tail = [e[1] for e in _entries(outs[0])]  # token ids of positions start .. n_prompt-1
        tokens = [_choice_entries(_entries(out), prompt_tail) for out in outs[1:]]
        normalized = [sum(e[0] for e in t) / len(t) if t else -math.inf for t in tokens]
        meta = {
            "normalized_logprobs": normalized,
            "prompt_tokens": n_prompt,
            "choice_tokens": [len(t) for t in tokens],
            "cached_tokens": head.get("meta_info", {}).get("cached_tokens"),
        }
        return SelectResult(pick(normalized), normalized, meta)


def _field(obj: Any, name: str) -> Any:
    if not isinstance(obj, dict) or name not in obj:
        raise BackendError(f"malformed server response: missing {name!r} in {str(obj)[:200]}")
    return obj[name]


def _entries(out: dict[str, Any]) -> list[list[Any]]:
    """`[logprob, token_id, text|null]` per position from logprob_start_len to the end of the input."""
    entries = _field(out, "meta_info").get("input_token_logprobs")
    if not isinstance(entries, list):
        raise BackendError("the server returned no input_token_logprobs; select cannot score")
    return entries


def _choice_entries(entries: list[list[Any]], prompt_tail: list[int]) -> list[list[Any]]:
    """The entries of the choice's tokens: from the first position whose token differs from the prompt's."""
    d = 0
    while d < len(prompt_tail) and d < len(entries) and entries[d][1] == prompt_tail[d]:
        d += 1
    choice = entries[d:]
    if any(e[0] is None for e in choice):
        raise BackendError(
            "the server returned null logprobs for a choice's tokens (the choice merges with the prompt's "
            f"last {len(prompt_tail)} tokens?); select cannot score it"
        )
    return choice
