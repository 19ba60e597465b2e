"""Supervisor: starts the scheduler and detokenizer processes (and this node's tensor-parallel ranks beyond
rank 0) and notices when one dies.

Start-up is a handshake: each child sends `{"status": "ready", ...facts}` (or `"error"` with a traceback)
over a pipe; the facts (context length, vocab size, backend, ...) are merged and returned to the
TokenizerManager. Afterwards `watch` polls the children; the first death is reported once through a
callback so the owner can fail its in-flight requests instead of letting them hang. A dead tensor-parallel
rank is a dead child like any other: the server exits rather than wait on a collective that cannot finish.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from runtime import ipc
from runtime.managers.child_process import init_child
from runtime.server_args import ServerArgs

logger = logging.getLogger("radixlm.supervisor")
STARTUP_TIMEOUT_S = 600
WATCH_INTERVAL_S = 0.5
DISK_FLUSH_S = 60.0  # how long a stopping scheduler may write its cached prefixes to --kv-disk-dir


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

    def start(self, frontend: bool = True) -> dict[str, Any]:
        """Spawn the children and wait until each reports ready; return the facts they sent.

        `frontend`: the scheduler (tensor-parallel rank 0) and detokenizer; without it (a worker-only node
        of a multi-node group) just this node's ranks. Raises ValueError for a --tp-size the model cannot be
        sharded over (before spawning anything), RuntimeError (after stopping every child) when one exits,
        fails or is not ready in time.
        """
        from runtime.managers.detokenizer.detokenizer import run_detokenizer_process
        from runtime.managers.scheduler.scheduler_process import run_scheduler_process
        from runtime.model_executor.tp_worker import run_tp_worker_process

        if self.args.tp_size > 1:
            _check_tp_fits(self.model_dir, self.args.tp_size)
        children: list[tuple[str, Callable]] = []
        if frontend:
            children += [("scheduler", run_scheduler_process), ("detokenizer", run_detokenizer_process)]
        for rank in self.args.tp_ranks_here:
            if rank > 0:
                children.append((f"tp-rank-{rank}", partial(run_tp_worker_process, rank=rank)))
        ctx = mp.get_context("spawn")
        conns = {}
        try:
            for name, target in children:
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
                # a tensor-parallel rank that fails leaves the others waiting in a collective: report it
                for other in [name, *(n for n in conns if n.startswith("tp-rank-"))]:
                    if not self.procs[other].is_alive():
                        if conns[other].poll():
                            self._raise_if_failed(other, conns[other].recv())
                        raise RuntimeError(
                            f"{other} process exited during startup (exit code {self.procs[other].exitcode})"
                        )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{name} process did not become ready within {self.startup_timeout_s:g}s"
                    )
            msg = conn.recv()
            self._raise_if_failed(name, msg)
            info.update({k: v for k, v in msg.items() if k != "status"})
        return info

    @staticmethod
    def _raise_if_failed(name: str, msg: dict[str, Any]) -> None:
        if msg["status"] != "ready":
            detail = f"{msg['message']}\n{msg.get('traceback', '')}"
            raise RuntimeError(f"{name} process failed to start: {detail}")

    def dead_child(self) -> str | None:
        """Which children died (all of them: a dead tensor-parallel rank soon takes rank 0 down with it, and
        the one to blame may come later in the list), or None while all are alive."""
        dead = [
            f"{name} process died (exit code {proc.exitcode})"
            for name, proc in self.procs.items()
            if not proc.is_alive()
        ]
        return "; ".join(dead) or None

    async def watch(self, on_death: Callable[[str], None], interval_s: float = WATCH_INTERVAL_S) -> None:
        """Poll the children until one dies, call `on_death(reason)` once, and return."""
        while True:
            await asyncio.sleep(interval_s)
            reason = self.dead_child()
            if reason is not None:
                on_death(reason)
                return

    def stop(self) -> None:
        """Stop the children and reap them (idempotent). With `--kv-disk-dir` the scheduler first gets a
        SIGTERM and up to DISK_FLUSH_S to write its cached prefixes to disk; the rest are killed."""
        scheduler = self.procs.get("scheduler")
        if getattr(self.args, "kv_disk_dir", None) and scheduler is not None and scheduler.is_alive():
            scheduler.terminate()
            scheduler.join(timeout=DISK_FLUSH_S)
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
        for proc in self.procs.values():
            proc.join(timeout=5)


def _check_tp_fits(model_dir: str, tp_size: int) -> None:
    """A --tp-size the model's heads cannot be split over fails here, before any rank loads weights."""
    from runtime.models.model_config import ModelConfig
    from runtime.models.model_loader import load_hf_config
    from runtime.models.parallel import check_tp_shardable

    cfg = ModelConfig.from_hf(load_hf_config(model_dir))
    check_tp_shardable(cfg.num_heads, cfg.num_kv_heads, tp_size)


def _child_main(name: str, target, args, model_dir, endpoints, conn) -> None:
    """Child entry: die with the parent (no orphans even after kill -9 of the server), name itself, run."""
    init_child(name)
    target(args, model_dir, endpoints, conn)
