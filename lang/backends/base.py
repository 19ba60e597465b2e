"""The interface every backend implements, and the values that cross it.

The interpreter speaks only this interface; a backend knows nothing about IR nodes. A `Prompt` carries both
views of the conversation so far -- the rendered text (for text-completion servers) and the structured
messages (for chat APIs) -- and each backend uses the one it needs.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from lang.chat_template import ChatTemplate

# The per-request options a backend may send with every request of the programs it runs: the server's
# `generate_input.OPTION_FIELDS` (tests/e2e/test_request_options.py keeps the two lists equal).
REQUEST_OPTIONS = ("timeout", "cache_salt", "session_id", "cache_ttl_s", "priority", "program_id")


def request_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """`options` checked for names: ValueError naming one the server does not take (values are the
    server's to check, and its 400 names the field)."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(REQUEST_OPTIONS))
    if unknown:
        raise ValueError(f"unknown request option(s) {unknown}; the options are {list(REQUEST_OPTIONS)}")
    return options


@dataclass(frozen=True)
class Prompt:
    text: str
    messages: tuple[dict[str, str], ...] = ()  # completed role blocks, in order
    open_role: str | None = None  # role whose block is open (its content so far is `open_content`)
    open_content: str = ""
    # the program run it belongs to: sent as `program_id` (unless the backend's options name one), so the
    # server schedules and retains the calls of one run, forks included, together
    program_id: str | None = None


@dataclass
class GenResult:
    text: str  # the whole generated text (for stream chunks: cumulative so far)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class SelectResult:
    index: int  # the chosen choice
    normalized_logprobs: list[float]  # per choice: sum of token logprobs / number of choice tokens
    meta_info: dict[str, Any] = field(default_factory=dict)


class Backend(ABC):
    """Executes generation and scoring requests for programs. Methods may be called from many threads."""

    @abstractmethod
    def chat_template(self) -> ChatTemplate:
        """The template used to render role blocks into the prompt text."""

    @abstractmethod
    def generate(self, prompt: Prompt, sampling: dict[str, Any]) -> GenResult:
        """Generate a continuation; `sampling` is keyed by SamplingParams field names."""

    def generate_stream(self, prompt: Prompt, sampling: dict[str, Any]) -> Iterator[GenResult]:
        """Yield cumulative results; the last one is final (has the finish reason). Default: one chunk."""
        yield self.generate(prompt, sampling)

    @abstractmethod
    def select(self, prompt: Prompt, choices: list[str]) -> SelectResult:
        """Score each choice as a continuation of the prompt (token-length-normalized logprob)."""

    def cache_prefix(self, prompt: Prompt) -> None:  # noqa: B027 -- optional hook, a no-op by default
        """Ask the backend to compute and keep the prompt's KV, so that forks sharing it reuse it."""

    def close(self) -> None:  # noqa: B027
        """Release connections; the backend must not be used afterwards."""


def pick(normalized: list[float]) -> int:
    """Index of the best score; the first one on ties; NaN/-inf never beat a finite score."""
    best = 0
    for i, score in enumerate(normalized):
        if not math.isnan(score) and (math.isnan(normalized[best]) or score > normalized[best]):
            best = i
    return best
