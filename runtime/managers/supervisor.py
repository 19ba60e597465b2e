"""Supervisor: starts the scheduler and detokenizer processes and notices when one dies.

Start-up is a handshake: each child sends `{"status": "ready", ...facts}` (or `"error"` with a traceback)
over a pipe; the facts (context length, vocab size, backend, ...) are merged and returned to the
TokenizerManager. Afterwards `watch` polls the children; the first death is reported once through a
callback so the owner can fail its in-flight requests instead of letting them hang.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

from runtime import ipc
from runtime.managers.child_process import init_child
from runtime.server_args import ServerArgs

logger = logging.getLogger("radixlm.supervisor")
STARTUP_TIMEOUT_S = 600
WATCH_INTERVAL_S = 0.5


class Supervisor:
    def __init__(
        self,
        args: ServerArgs,
        model_dir: str,
        endpoints: ipc.IpcEndpoints,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ):
        self.args = args
        self.model_dir = model_dir
        self.endpoints = endpoints
        self.startup_timeout_s = startup_timeout_s
        self.procs: dict[str, mp.Process] = {}

    def start(self) -> dict[str, Any]:
        """Spawn both children and wait until each reports ready; return the facts they sent.

        Raises RuntimeError (after stopping every child) when one exits, fails or is not ready in time.
        """
        from runtime.managers.detokenizer import run_detokenizer_process
        from runtime.managers.scheduler_process import run_scheduler_process

        ctx = mp.get_context("spawn")
        conns = {}
        try:
            for name, target in (
                ("scheduler", run_scheduler_process),
                ("detokenizer", run_detokenizer_process),
            ):
                parent_conn, child_conn = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_child_main,
                    name=f"radixlm-{name}",
                    args=(name, target, self.args, self.model_dir, self.endpoints, child_conn),
                    daemon=True,
                )
                proc.start()
                self.procs[name], conns[name] = proc, parent_conn
            return self._await_ready(conns)
        except BaseException:  # a failed start (or Ctrl-C while waiting) leaves no child behind
            self.stop()
            raise

    def _await_ready(self, conns: dict[str, Any]) -> dict[str, Any]:
        info: dict[str, Any] = {}
        deadline = time.monotonic() + self.startup_timeout_s
        for name, conn in conns.items():
            while not conn.poll(0.2):
                if not self.procs[name].is_alive():
                    raise RuntimeError(
                        f"{name} process exited during startup (exit code {self.procs[name].exitcode})"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{name} process did not become ready within {self.startup_timeout_s:g}s"
                    )
            msg = conn.recv()
            if msg["status"] != "ready":
                raise RuntimeError(
                    f"{name} process failed to start: {msg['message']}\n{msg.get('traceback', '')}"
                )
            info.update({k: v for k, v in msg.items() if k != "status"})
        return info

    def dead_child(self) -> str | None:
        """The reason the first dead child died, or None while all are alive."""
        for name, proc in self.procs.items():
            if not proc.is_alive():
                return f"{name} process died (exit code {proc.exitcode})"
        return None

    async def watch(self, on_death: Callable[[str], None], interval_s: float = WATCH_INTERVAL_S) -> None:
        """Poll the children until one dies, call `on_death(reason)` once, and return."""
        while True:
            await asyncio.sleep(interval_s)
            reason = self.dead_child()
            if reason is not None:
                on_death(reason)
                return

    def stop(self) -> None:
        """Kill the children and reap them (idempotent)."""
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
        for proc in self.procs.values():
            proc.join(timeout=5)


def _child_main(name: str, target, args, model_dir, endpoints, conn) -> None:
    """Child entry: die with the parent (no orphans even after kill -9 of the server), name itself, run."""
    init_child(name)
    target(args, model_dir, endpoints, conn)
