"""The user-facing constructors: each returns an IR node to append with `s += ...`."""

from __future__ import annotations

from typing import Any

from lang import sampling as sampling_kw
from lang.ir import ExprLike, ExprList, Gen, RoleBegin, RoleEnd, Select, role

# Regexes for the typed helpers (the server compiles them into its constrained decoder).
INT_REGEX = r"-?(0|[1-9][0-9]*)"
STRING_REGEX = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt])*"'


def gen(name: str | None = None, *, max_tokens: int | None = None, **sampling: Any) -> Gen:
    """Generate text into variable `name`.

    Sampling keywords are `SamplingParams` fields (`stop`, `temperature`, `top_p`, `top_k`, `regex`,
    `json_schema` (dict or JSON text), `ignore_eos`, ...) plus `max_tokens` for `max_new_tokens`. Unset ones
    take the run's defaults, then the server's. Invalid values raise ValueError here.
    """
    return Gen(name, sampling_kw.normalize({"max_tokens": max_tokens, **sampling}))


def gen_int(name: str | None = None, *, max_tokens: int | None = 16, **sampling: Any) -> Gen:
    """Generate a decimal integer (text matching INT_REGEX); read it with `int(s[name])`."""
    return gen(name, max_tokens=max_tokens, regex=INT_REGEX, **sampling)


def gen_string(name: str | None = None, *, max_tokens: int | None = 64, **sampling: Any) -> Gen:
    """Generate a double-quoted string literal (quotes included, JSON escapes allowed)."""
    return gen(name, max_tokens=max_tokens, regex=STRING_REGEX, **sampling)


def select(name: str | None = None, choices: list[str] | tuple[str, ...] = ()) -> Select:
    """Append the choice the model finds most likely after the prompt (mean logprob over the choice's
    tokens).
    """
    if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select needs a non-empty list of non-empty strings as choices")
    return Select(name, tuple(choices))


def system(body: ExprLike | None = None) -> ExprList:
    return role("system", body)


def user(body: ExprLike | None = None) -> ExprList:
    return role("user", body)


def assistant(body: ExprLike | None = None) -> ExprList:
    return role("assistant", body)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
