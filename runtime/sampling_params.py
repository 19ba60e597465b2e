"""Sampling parameters: defined once, shared by the runtime, the HTTP layer and the DSL.

`SamplingParams.from_dict` is the single entry point for untrusted input: it rejects unknown
fields and wrong types with a `ValueError` that names the field, so every layer reports the
same message (HTTP turns it into a 400).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

# Upper bounds that keep a single request from monopolising the server; bigger values are
# almost always client bugs (e.g. max_tokens=1e9). The stop strings' bounds are server options
# (--max-stop-strings, --max-stop-chars), checked by the tokenizer manager.
MAX_NEW_TOKENS_LIMIT = 1 << 20
MAX_N = 64
MAX_DRAFT_TOKENS = 32  # the bound of --speculative-num-draft-tokens too
# Integers cross process boundaries as MessagePack and end up in int64 tensors: anything wider is refused
# here.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    regex: str | None = None
    json_schema: str | None = None  # JSON text of the schema
    lark: str | None = None  # llguidance Lark grammar text (may embed %json{...} schemas)
    n: int = 1
    no_stop_trim: bool = False
    seed: int | None = None
    # this request's draft length bound under --speculative-algorithm ngram/suffix (None: the server's
    # --speculative-num-draft-tokens; 0: no speculation for this request; never above the server's)
    speculative_num_draft_tokens: int | None = None
    # ---- SGLang wire compatibility: the rest of SGLang's sampling parameters (see `_verify_sglang`) ----
    stop_regex: list[str] = field(default_factory=list)  # stop when one matches the output's tail
    sampling_seed: int | None = None  # SGLang's name for `seed`
    stream_interval: int | None = None  # this request's chunk size in tokens (None: --stream-interval)
    ebnf: str | None = None  # accepted only as null until wired to the grammar backends
    structural_tag: str | None = None  # likewise
    # OpenAI's `logit_bias`: token id (its decimal text, as JSON keys are) -> bias in [-100, 100], added to
    # that token's logit before the grammar mask and the draw, at every sampled row (speculative rows
    # included)
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None  # likewise: radixlm has no custom logit processors

    def __post_init__(self) -> None:
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        elif self.stop_regex is None:
            self.stop_regex = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)
        self.verify()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1

    @property
    def has_grammar(self) -> bool:
        return self.regex is not None or self.json_schema is not None or self.lark is not None

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, spec) of this request's grammar (constrained.backends kinds), None without one."""
        if self.regex is not None:
            return "regex", self.regex
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        if self.lark is not None:
            return "lark", self.lark
        return None

    def verify(self) -> None:
        """Raise ValueError naming the first invalid field."""
        _check_type("max_new_tokens", self.max_new_tokens, int)
        _check_type("min_new_tokens", self.min_new_tokens, int)
        _check_type("top_k", self.top_k, int)
        _check_type("n", self.n, int)
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
        ):
            _check_type(name, getattr(self, name), (int, float))
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            _check_type(name, getattr(self, name), bool)
        if not 0 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise ValueError(
                f"max_new_tokens must be in [0, {MAX_NEW_TOKENS_LIMIT}], got {self.max_new_tokens}"
            )
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX
            for t in self.stop_token_ids
        ):
            raise ValueError("stop_token_ids must be a list of non-negative 64-bit integers")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("regex must be a string")
        self._verify_logit_bias()
        if self.json_schema is not None:
            if not isinstance(self.json_schema, str):
                raise ValueError("json_schema must be a JSON object or its JSON text")
            try:
                json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            except RecursionError:
                # Python's parser recurses per level and gives up near 1000: far past the grammar check's
                # depth limit, which answers this spec with a 400 naming that limit (constrained.spec)
                pass
        if self.lark is not None and not isinstance(self.lark, str):
            raise ValueError("lark must be a string (a Lark grammar)")
        given = [name for name in ("regex", "json_schema", "lark") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are mutually exclusive")
        if self.seed is not None:
            _check_type("seed", self.seed, int)
        if self.speculative_num_draft_tokens is not None:
            _check_type("speculative_num_draft_tokens", self.speculative_num_draft_tokens, int)
            if not 0 <= self.speculative_num_draft_tokens <= MAX_DRAFT_TOKENS:
                raise ValueError(
                    f"speculative_num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}] (0: no speculation for "
                    f"this request), got {self.speculative_num_draft_tokens}"
                )
        self._verify_sglang()

    def _verify_logit_bias(self) -> None:
        """OpenAI's rules: keys are token ids (JSON keys are strings: "50256"; ints from Python), values
        numbers in [-100, 100]. Normalises the keys to canonical decimal text. Whether the ids are inside the
        vocabulary is checked where the vocabulary is known (`logit_bias_problem`)."""
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError("logit_bias must be an object mapping token ids to biases in [-100, 100]")
        out: dict[str, float] = {}
        for key, value in bias.items():
            tok = key if isinstance(key, int) and not isinstance(key, bool) else None
            if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19:
                tok = int(key)
            if tok is None or not 0 <= tok <= INT64_MAX:
                raise ValueError(f"logit_bias: key {key!r} is not a token id (a non-negative integer)")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias[{key!r}] must be a number in [-100, 100], got {value!r}")
            if str(tok) in out:
                raise ValueError(f"logit_bias names token {tok} twice")
            out[str(tok)] = float(value)
        self.logit_bias = out or None

    def logit_bias_problem(self, vocab_size: int) -> str | None:
        """Why `logit_bias` does not fit a vocabulary of `vocab_size` ids (the request's 400), or None."""
        bad = [int(k) for k in self.logit_bias or {} if int(k) >= vocab_size]
        if bad:
            shown = sorted(bad)[:5]
            return f"logit_bias: token ids must be in [0, {vocab_size}) (the vocabulary), got {shown}"
        return None

    def _verify_sglang(self) -> None:
        """SGLang's parameters: implemented ones are checked, the others are a ValueError naming them when set
        to anything but their default (its frontend sends some defaults, e.g. `stop_regex: []`, always)."""
        if not isinstance(self.stop_regex, list) or not all(isinstance(r, str) for r in self.stop_regex):
            raise ValueError("stop_regex must be a string or a list of strings")
        for pattern in self.stop_regex:
            compile_stop_regex(pattern)
        if self.sampling_seed is not None:
            _check_type("sampling_seed", self.sampling_seed, int)
            if self.seed is not None and self.seed != self.sampling_seed:
                raise ValueError("seed and sampling_seed (its SGLang name) differ: give one of them")
            self.seed = self.sampling_seed
        if self.stream_interval is not None:
            _check_type("stream_interval", self.stream_interval, int)
            if not 1 <= self.stream_interval <= MAX_NEW_TOKENS_LIMIT:
                raise ValueError(
                    f"stream_interval must be in [1, {MAX_NEW_TOKENS_LIMIT}], got {self.stream_interval}"
                )
        for name, why in UNSUPPORTED_SGLANG_PARAMS.items():
            if getattr(self, name):  # None, {} and "" are the defaults SGLang clients send
                raise ValueError(f"{name} is not supported by radixlm ({why}); leave it unset or null")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError("sampling_params must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        # JSON null means "use the default" for every field.
        return cls(**{k: v for k, v in d.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# SGLang sampling parameters radixlm accepts only at their default, and why.
UNSUPPORTED_SGLANG_PARAMS = {
    "ebnf": "EBNF grammars are not wired yet; use regex or json_schema",
    "structural_tag": "structural tags are not supported; use json_schema or the OpenAI tools API",
    "custom_params": "radixlm has no custom logit processors",
}


def compile_stop_regex(pattern: str) -> tuple[Any, int]:
    """(compiled pattern, the most characters a match can span, 2**64 when unbounded) of a stop_regex, or a
    ValueError naming it. Python's `re` decides what is valid (SGLang's semantics); the matching runs on the
    `regex` module, which can stop a backtracking search at a deadline."""
    import re

    import regex

    try:
        re.compile(pattern)
        width = re._parser.parse(pattern).getwidth()[1]
        compiled = regex.compile(pattern)
    except (re.error, regex.error, RecursionError, OverflowError) as e:
        raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None
    return compiled, width


class TokenBudgetError(ValueError):
    """A request's tokens do not fit: an empty prompt, prompt + output past the context, or past the KV pool.

    Raised by `check_token_budget` in every layer (HTTP, tokenizer manager, scheduler) so a client sees the
    same message whichever layer caught it; the numbers are kept as attributes for callers and tests.
    """

    def __init__(
        self, message: str, prompt_len: int, max_new_tokens: int | None, limit: int | None = None
    ) -> None:
        super().__init__(message)
        self.prompt_len = prompt_len
        self.max_new_tokens = max_new_tokens
        self.limit = limit


def check_token_budget(
    prompt_len: int, max_new_tokens: int | None, context_length: int, kv_pool_size: int | None = None
) -> int:
    """Check that a request fits and return its `max_new_tokens`.

    `max_new_tokens=None` (OpenAI's unset `max_tokens`) means "what is left of the context" and needs room
    for at least one token. `kv_pool_size`, when known, also bounds prompt + output: a request bigger than
    the whole pool could never be scheduled.
    """
    if prompt_len <= 0:
        raise TokenBudgetError("the prompt is empty (no tokens)", prompt_len, max_new_tokens)
    wanted = "at least 1" if max_new_tokens is None else str(max_new_tokens)
    if prompt_len + (1 if max_new_tokens is None else max_new_tokens) > context_length:
        raise TokenBudgetError(
            f"the prompt ({prompt_len} tokens) + max_new_tokens ({wanted}) exceeds the context length "
            f"({context_length})",
            prompt_len,
            max_new_tokens,
            context_length,
        )
    if max_new_tokens is None:
        max_new_tokens = context_length - prompt_len
    if kv_pool_size is not None and prompt_len + max_new_tokens > kv_pool_size:
        raise TokenBudgetError(
            f"the prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) needs "
            f"{prompt_len + max_new_tokens} KV slots; the pool has {kv_pool_size}",
            prompt_len,
            max_new_tokens,
            kv_pool_size,
        )
    return max_new_tokens


def _check_type(name: str, value: Any, types: type | tuple[type, ...]) -> None:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ValueError(f"{name} must be a number, got a boolean")
    if not isinstance(value, types):
        want = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise ValueError(f"{name} must be of type {want}, got {type(value).__name__}")
    if types is int and not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must fit in a signed 64-bit integer, got {value}")
