"""Execute IR nodes against a backend, one node at a time, for one program state.

An `Executor` owns the state of one conversation -- its text, completed messages, the open role block,
variables and their meta info -- plus an append-only `EventLog` of the text pieces it added, which is what
`text_iter` replays (from any thread, at any time, so a late reader misses nothing). Dispatch is by node type
through `functools.singledispatchmethod`: one small method per node kind.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import singledispatchmethod
from typing import Any

from lang import sampling as sampling_kw
from lang.backends.base import Backend, Prompt
from lang.chat_template import ChatTemplate
from lang.errors import ProgramError
from lang.ir import Expr, ExprList, Gen, RoleBegin, RoleEnd, Select, Text


class EventLog:
    """Text pieces in the order they were appended, tagged with the variable they belong to (None: other).

    `done` is set once no more pieces will come (immediately for states executed synchronously); `error` is
    the exception that ended a streamed program, re-raised to readers after the pieces before it.
    """

    def __init__(self, done: bool) -> None:
        self.pieces: list[tuple[str | None, str]] = []
        self.done = done
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def push(self, var: str | None, delta: str) -> None:
        if delta:
            with self.cond:
                self.pieces.append((var, delta))
                self.cond.notify_all()

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        with self.cond:
            self.done, self.error = True, error
            self.cond.notify_all()

    def iter(self, var: str | None) -> Iterator[str]:
        """Yield the deltas of `var` (every piece if None) as they arrive;
        raise the program's error at the end.
        """
        i = 0
        while True:
            with self.cond:
                self.cond.wait_for(lambda i=i: i < len(self.pieces) or self.done)
                batch, done, error = self.pieces[i:], self.done, self.error
            i += len(batch)
            for name, delta in batch:
                if var is None or name == var:
                    yield delta
            if done and i >= len(self.pieces):
                if error is not None:
                    raise error
                return


@dataclass(frozen=True)
class OpenRole:
    role: str
    start: int  # offset in the text where the block's content begins
    suffix: str  # appended when the block ends


class Executor:
    """Runs nodes for one state. Not thread-safe: one thread appends to a state at a time (forks are separate
    executors, so they may run in parallel)."""

    def __init__(
        self, backend: Backend, defaults: dict[str, Any], stream: bool = False, program_id: str | None = None
    ) -> None:
        self.backend = backend
        # one id per program run, kept by its forks: every request of the run names it (`Prompt.program_id`)
        self.program_id = program_id or uuid.uuid4().hex
        self.defaults = defaults  # normalized sampling kwargs applied to every gen unless overridden
        self.stream = stream
        self.text = ""
        self.messages: list[dict[str, str]] = []
        self.open_role: OpenRole | None = None
        self.variables: dict[str, Any] = {}
        self.meta: dict[str, dict[str, Any]] = {}
        self.events = EventLog(done=not stream)
        self._template: ChatTemplate | None = None

    # ---------------------------------------------------------------------------------------------- helpers
    @property
    def template(self) -> ChatTemplate:
        if self._template is None:
            self._template = self.backend.chat_template()
        return self._template

    def prompt(self) -> Prompt:
        role = self.open_role
        return Prompt(
            text=self.text,
            messages=tuple(dict(m) for m in self.messages),
            open_role=role.role if role else None,
            open_content=self.text[role.start :] if role else "",
            program_id=self.program_id,
        )

    def _append(self, text: str, var: str | None = None, emit: bool = True) -> None:
        self.text += text
        if emit:
            self.events.push(var, text)

    def _set_var(self, name: str | None, value: Any, meta: dict[str, Any]) -> None:
        if name is not None:
            self.variables[name] = value
            self.meta[name] = meta
            self.events.notify()

    def copy(self) -> Executor:
        """A synchronous executor with the same conversation (used by fork)."""
        other = Executor(self.backend, self.defaults, stream=False, program_id=self.program_id)
        other.text, other.open_role = self.text, self.open_role
        other.messages = [dict(m) for m in self.messages]
        other.variables, other.meta = dict(self.variables), dict(self.meta)
        other._template = self._template
        return other

    # ---------------------------------------------------------------------------------------------- dispatch
    @singledispatchmethod
    def execute(self, node: Expr) -> None:
        raise TypeError(f"no interpreter rule for {type(node).__name__}")

    @execute.register
    def _text(self, node: Text) -> None:
        self._append(node.value)

    @execute.register
    def _list(self, node: ExprList) -> None:
        for item in node.items:
            self.execute(item)

    @execute.register
    def _role_begin(self, node: RoleBegin) -> None:
        if self.open_role is not None:
            raise ProgramError(
                f"cannot begin a {node.role!r} block inside the open {self.open_role.role!r} block"
            )
        prefix, suffix = self.template.role_affixes(self.messages, node.role)
        self._append(prefix)
        self.open_role = OpenRole(node.role, len(self.text), suffix)

    @execute.register
    def _role_end(self, node: RoleEnd) -> None:
        role = self.open_role
        if role is None or role.role != node.role:
            raise ProgramError(
                f"{node.role}_end without a matching {node.role}_begin (open: {role and role.role})"
            )
        content = self.text[role.start :]
        self._append(role.suffix)
        self.messages.append({"role": role.role, "content": content})
        self.open_role = None

    @execute.register
    def _gen(self, node: Gen) -> None:
        params = sampling_kw.merge(self.defaults, node.sampling)
        end = ChatTemplate.end_token(self.open_role.suffix) if self.open_role else None
        if end is not None and end not in params.get("stop", []):
            params["stop"] = [*params.get("stop", []), end]  # a reply ends where its role block does
        prompt = self.prompt()
        if not self.stream:
            result = self.backend.generate(prompt, params)
            self._append(result.text, node.name)
        else:
            emitted = ""
            result = None
            for result in self.backend.generate_stream(prompt, params):
                if result.text.startswith(emitted):  # cumulative text: send only what is new
                    self.events.push(node.name, result.text[len(emitted) :])
                    emitted = result.text
            if result is None:
                raise ProgramError("the backend's stream ended without any result")
            self._append(result.text, node.name, emit=False)
        self._set_var(node.name, result.text, result.meta_info)

    @execute.register
    def _select(self, node: Select) -> None:
        result = self.backend.select(self.prompt(), list(node.choices))
        choice = node.choices[result.index]
        self._append(choice, node.name)
        meta = {
            **result.meta_info,
            "choices": list(node.choices),
            "normalized_logprobs": result.normalized_logprobs,
        }
        self._set_var(node.name, choice, meta)
