"""Intermediate representation: what `s += ...` appends to a program state.

A program is ordinary Python that builds these nodes one statement at a time; the interpreter executes each
node as soon as it is appended (so Python control flow can read earlier results). Nodes are immutable values
with no backend knowledge; `+` concatenates them into an `ExprList`, and a plain `str` means `Text`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")


class Expr:
    """Base of every node; supports `a + b` (and `"text" + node`) to build sequences."""

    def __add__(self, other: ExprLike) -> ExprList:
        return ExprList((self, to_expr(other)))

    def __radd__(self, other: ExprLike) -> ExprList:
        return ExprList((to_expr(other), self))


@dataclass(frozen=True)
class Text(Expr):
    """Literal text appended to the prompt."""

    value: str


@dataclass(frozen=True)
class Gen(Expr):
    """Generate text into variable `name` (None: append without storing).

    `sampling` is keyed by `SamplingParams` field names (already validated by `lang.sampling.normalize`).
    """

    name: str | None
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Select(Expr):
    """Append the choice with the highest token-length-normalized logprob given the prompt; store it."""

    name: str | None
    choices: tuple[str, ...]


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class ExprList(Expr):
    """A sequence executed in order (nested lists are flattened on construction)."""

    items: tuple[Expr, ...]

    def __post_init__(self) -> None:
        flat: list[Expr] = []
        for item in self.items:
            flat.extend(item.items if isinstance(item, ExprList) else (item,))
        object.__setattr__(self, "items", tuple(flat))


ExprLike = Expr | str


def to_expr(value: ExprLike) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(
        f"cannot append {type(value).__name__} to a program state (expected str or a lang expression)"
    )


def role(name: str, body: ExprLike | None = None) -> ExprList:
    """`RoleBegin, body, RoleEnd` as one expression."""
    if name not in ROLES:
        raise ValueError(f"unknown role {name!r} (expected one of {ROLES})")
    items: tuple[Expr, ...] = (
        (RoleBegin(name),) + ((to_expr(body),) if body is not None else ()) + (RoleEnd(name),)
    )
    return ExprList(items)
