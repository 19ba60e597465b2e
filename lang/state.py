"""`ProgramState`: the `s` a program appends to, and what `run` returns."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lang.interpreter import Executor
from lang.ir import ExprLike, to_expr


class ProgramState:
    """The conversation of one program run: `s += expr`, `s["var"]`, `s.text()`, `s.fork(n)`, `s.text_iter()`.

    A streamed run executes the program in a background thread; readers from other threads (`text()`,
    `s["var"]`, `messages()`) wait for what they ask for, and re-raise the program's error.
    """

    def __init__(self, executor: Executor) -> None:
        self._ex = executor
        self._runner: threading.Thread | None = None  # set for streamed runs
        self.ret_value: Any = None  # what the program function returned (after it finished)

    # ---------------------------------------------------------------------------------------------- building
    def __iadd__(self, other: ExprLike) -> ProgramState:
        self._ex.execute(to_expr(other))
        return self

    def fork(self, n: int) -> ForkGroup:
        """n independent states that continue from this one. The shared prefix is prefilled once first, so
        each fork's first request hits the server's prefix cache."""
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        self._ex.backend.cache_prefix(self._ex.prompt())
        return ForkGroup(ProgramState(self._ex.copy()) for _ in range(n))

    # ---------------------------------------------------------------------------------------------- reading
    def _foreign(self) -> bool:
        return self._runner is not None and threading.current_thread() is not self._runner

    def sync(self) -> ProgramState:
        """Wait until a streamed program has finished; re-raise its error. No-op for synchronous runs."""
        if self._foreign():
            self._runner.join()  # type: ignore[union-attr]
            if self._ex.events.error is not None:
                raise self._ex.events.error
        return self

    def __getitem__(self, name: str) -> Any:
        log = self._ex.events
        if self._foreign():
            with log.cond:
                log.cond.wait_for(lambda: name in self._ex.variables or log.done)
            if name not in self._ex.variables and log.error is not None:
                raise log.error
        if name not in self._ex.variables:
            raise KeyError(f"no variable {name!r} in this program state (have: {sorted(self._ex.variables)})")
        return self._ex.variables[name]

    def __contains__(self, name: str) -> bool:
        return name in self._ex.variables

    def get_var(self, name: str) -> Any:
        return self[name]

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """The backend's meta info for a gen/select variable (token counts, cached_tokens,
        finish_reason, ...).
        """
        self[name]  # waits / raises like reading the variable
        return self._ex.meta[name]

    @property
    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self._ex.variables)

    def text(self) -> str:
        """The whole prompt text so far (roles rendered with the model's chat template)."""
        return self.sync()._ex.text

    def messages(self) -> list[dict[str, str]]:
        """Completed role blocks as chat messages ({"role", "content"})."""
        return [dict(m) for m in self.sync()._ex.messages]

    def text_iter(self, var: str | None = None) -> Iterator[str]:
        """Yield text as it is produced: pieces of variable `var`, or every appended piece if None."""
        return self._ex.events.iter(var)

    def __repr__(self) -> str:
        return f"ProgramState(text={self._ex.text[-80:]!r}, variables={sorted(self._ex.variables)})"


class ForkGroup(list):
    """The states made by `fork`; `forks += expr` appends expr to every fork, running them in parallel."""

    def __iadd__(self, other: ExprLike) -> ForkGroup:  # type: ignore[override,misc]
        expr = to_expr(other)
        states: list[ProgramState] = list(self)
        if len(states) == 1:
            states[0] += expr
            return self
        with ThreadPoolExecutor(max_workers=len(states)) as pool:
            futures = [pool.submit(st._ex.execute, expr) for st in states]
            for fut in futures:
                fut.result()  # re-raises the first failure
        return self
