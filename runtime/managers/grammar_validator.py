"""Checks regex / JSON-Schema specs before a request is queued, in a child process with a time limit.

Some specs make automaton construction run for minutes and eat gigabytes; a Python thread cannot be stopped,
so the check runs in a helper process that is killed and replaced when it exceeds its time, and whose
address space is capped (RLIMIT_AS, the same ``--grammar-memory-mb`` as the compile workers) so a pattern
whose automaton explodes fails the check instead of growing without bound. Verdicts are cached, so a spec is
checked once.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from collections import OrderedDict

from runtime.managers.child_process import init_child

VALIDATION_TIMEOUT_S = 15.0
VALIDATION_MEMORY_MB = 2048
CACHE_SIZE = 512


class GrammarValidator:
    def __init__(self, timeout_s: float = VALIDATION_TIMEOUT_S, memory_mb: int = VALIDATION_MEMORY_MB):
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self._proc: mp.Process | None = None
        self._conn = None
        self._lock: asyncio.Lock | None = None
        self._verdicts: OrderedDict[tuple[str, str], str | None] = OrderedDict()

    async def validate(self, kind: str, spec: str) -> str | None:
        """None when the spec is usable, else the reason it is not."""
        key = (kind, spec)
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            return self._verdicts[key]
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            verdict = await asyncio.to_thread(self._check, kind, spec)
        self._verdicts[key] = verdict
        if len(self._verdicts) > CACHE_SIZE:
            self._verdicts.popitem(last=False)
        return verdict

    def _check(self, kind: str, spec: str) -> str | None:
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._conn.send((kind, spec))
        if not self._conn.poll(self.timeout_s):
            self.close()
            return f"the {kind} is too complex (checking it took longer than {self.timeout_s:.0f}s)"
        try:
            return self._conn.recv()
        except (EOFError, OSError):  # the checker died: crashed, or killed by close() from another thread
            self.close()
            return (
                f"the {kind} is too complex: checking it needs more memory than the limit of "
                f"{self.memory_mb} MB (--grammar-memory-mb), or the checker crashed"
            )

    def _start(self) -> None:
        if self._conn is not None:
            self._conn.close()  # the previous checker's (killed) pipe; closed here, not in close(), so a
            # thread still polling it after a kill from another thread sees EOF rather than a closed handle
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve, args=(child, self.memory_mb), name="radixlm-grammar-check", daemon=True
        )
        self._proc.start()
        child.close()  # only the child holds its end: killing it wakes a waiting poll() with EOF at once
        self._conn = parent

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        self._proc = None


def _serve(conn, memory_mb: int) -> None:
    init_child("grammar")  # never outlive the server; `radixlm::grammar` in ps
    import resource

    from constrained.compile_pool import _address_space_bytes
    from constrained.errors import GrammarError
    from constrained.spec import validate_spec

    cap = _address_space_bytes() + memory_mb * (1 << 20)  # on top of what the imports already mapped
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    while True:
        kind, spec = conn.recv()
        try:
            validate_spec(kind, spec)
            conn.send(None)
        except GrammarError as e:
            conn.send(str(e))
        except MemoryError:
            conn.send(f"the {kind} is too complex: checking it needs more memory than {memory_mb} MB")
