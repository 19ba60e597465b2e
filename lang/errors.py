"""Exceptions a DSL program can see.

Both are `RuntimeError`s so that a caller who only knows "the program failed" can catch one type; the
subclasses say whether the server refused the work (`BackendError`) or the program itself is malformed
(`ProgramError`).
"""

from __future__ import annotations


class BackendError(RuntimeError):
    """The backend (server, engine, OpenAI endpoint) rejected or failed a request.

    `message` is the server's own explanation (e.g. the 400 body's `error.message`), unchanged, so a user sees
    exactly why; `status` is the HTTP status when there was one.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message if status is None else f"[HTTP {status}] {message}")
        self.message = message
        self.status = status


class ProgramError(RuntimeError):
    """The program is inconsistent: nested or mismatched roles, an unknown variable, an unusable template."""
