"""Grammar compilation in worker processes, each capped in memory and in compile time.

outlines-core's Index construction can need tens of GB and minutes for an innocent-looking schema (a 1 KB
schema with ``maxLength: 8192`` strings took a scheduler to 23 GB and the OOM killer). A thread cannot be
stopped nor its memory bounded, so every compile runs in a worker process:

* memory: the worker sets RLIMIT_AS to (its address space after start-up) + ``memory_mb``; an allocation past
  it fails inside the worker (a Python MemoryError, or a Rust allocation abort), never in the scheduler;
* time: the clock starts when a worker takes the job (queue wait is not counted); past ``timeout_s`` the
  worker is SIGKILLed, so a timed-out compile stops consuming CPU at once;
* a breached or crashed worker is replaced on the next job; the job's future fails with a GrammarError that
  names the limit (the server answers 400);
* the Index comes back pickled through the pipe (outlines-core's ``__reduce__``: a flat serialization of the
  transition table, ~10-30 ms for a large schema) and the compile cache stays in the parent
  (``GrammarCompiler``), so it survives worker restarts.

Workers are plain ``python -c`` subprocesses talking over a socketpair wrapped as a multiprocessing
``Connection``, not ``multiprocessing`` spawns: a spawn re-runs the parent's main script (a server entry point
or pytest, pulling in torch: ~300 MB of address space inside the cap, and seconds of start-up). This module
imports only the standard library at the top for the same reason (see ``constrained/__init__``).
"""

from __future__ import annotations

import ctypes
import os
import queue
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

DEFAULT_MEMORY_MB = 2048  # per worker; jsonschemabench's heaviest compiling schemas peak near 1 GB
DEFAULT_TIMEOUT_S = 120.0  # compile time only; the slowest compiling jsonschemabench schemas take ~90 s
STARTUP_TIMEOUT_S = 120.0  # a worker's imports (numpy, outlines-core): ~1 s, much more on a loaded machine
PROC_TITLE = "radixlm::grammar"


@dataclass(frozen=True)
class CompileResult:
    """What a worker sends back: the regex compiled (for diagnostics) and its Index (end marker included)."""

    regex: str
    index: object  # outlines_core.Index
    seconds: float  # compile time inside the worker (the spec check and the Index build)


class CompilePool:
    """``submit(kind, spec)`` -> Future[CompileResult]; at most ``workers`` compiles run at once.

    The future fails with ``constrained.errors.GrammarError`` for an unusable spec, a compile over the time
    limit, or one over the memory limit. Thread-safe.
    """

    def __init__(
        self,
        vocab,  # constrained.vocab.TokenVocabulary
        whitespace_pattern: str,
        workers: int = 2,
        memory_mb: int = DEFAULT_MEMORY_MB,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        if workers < 1 or memory_mb < 16 or timeout_s <= 0:
            raise ValueError(
                f"bad compile pool limits: workers={workers} memory_mb={memory_mb} timeout_s={timeout_s}"
            )
        import pickle

        self._vocab_blob = pickle.dumps(vocab.outlines)  # sent to every (re)started worker
        self.whitespace_pattern = whitespace_pattern
        self.memory_mb = memory_mb
        self.timeout_s = timeout_s
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen | None] = [None] * workers
        self._closed = False
        self.restarts = 0  # workers killed or found dead, then replaced
        self._threads = [
            threading.Thread(target=self._slot, args=(i,), name=f"grammar-slot-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, kind: str, spec: str) -> Future:
        future: Future = Future()
        if self._closed:
            future.set_exception(RuntimeError("grammar compile pool is shut down"))
            return future
        self._jobs.put((kind, spec, future))
        return future

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [p.pid for p in self._procs if p is not None and p.poll() is None]

    def shutdown(self) -> None:
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=5)
        while True:  # jobs nobody will take
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[2].set_exception(RuntimeError("grammar compile pool is shut down"))

    # ---- one slot: a thread that owns (at most) one worker process ---------------------------------------
    # The slot thread starts its worker and lives as long as the pool: PR_SET_PDEATHSIG fires when the
    # *thread* that created the child exits, so workers must not be started from short-lived threads.
    def _slot(self, slot: int) -> None:
        proc, conn = None, None
        while True:
            job = self._jobs.get()
            if job is None:
                break
            kind, spec, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if proc is None or proc.poll() is not None:
                    proc, conn = self._start(slot, conn)
                outcome = self._run(proc, conn, kind, spec)
            except Exception as err:  # a failed start (spawn error): report it, keep the slot alive
                outcome = err
                proc = None
            if isinstance(outcome, _Breach):
                self._kill(slot, proc)
                proc = None
                outcome = outcome.error
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        self._kill(slot, proc)
        if conn is not None:
            conn.close()

    def _run(self, proc: subprocess.Popen, conn, kind: str, spec: str):
        from constrained.errors import GrammarError

        conn.send((kind, spec))
        # the compile clock starts here: the job waited in the queue until this worker was free
        if not conn.poll(self.timeout_s):
            return _Breach(
                GrammarError(
                    f"{kind} is too complex: compiling it took longer than the limit of {self.timeout_s:g} s "
                    "(--grammar-timeout-s)"
                )
            )
        try:
            reply = conn.recv()
        except (
            EOFError,
            OSError,
        ):  # the worker died mid-compile: an allocation abort past RLIMIT_AS, or worse
            _reap(proc)
            return _Breach(GrammarError(self._memory_message(kind, f"the compile worker died: {_how(proc)}")))
        status = reply[0]
        if status == "ok":
            return CompileResult(regex=reply[1], index=reply[2], seconds=reply[3])
        if status == "memory":
            return _Breach(GrammarError(self._memory_message(kind, "out of memory")))
        return GrammarError(reply[1])

    def _memory_message(self, kind: str, detail: str) -> str:
        return (
            f"{kind} is too complex: compiling it needs more memory than the limit of {self.memory_mb} MB "
            f"(--grammar-memory-mb; {detail})"
        )

    def _start(self, slot: int, old_conn):
        if old_conn is not None:
            old_conn.close()
        from multiprocessing.connection import Connection

        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        # the worker imports this very package, wherever it was imported from here (a checkout, a wheel)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env.setdefault(
            "OPENBLAS_NUM_THREADS", "1"
        )  # BLAS thread buffers would be address space under the cap
        fd = child_sock.fileno()
        proc = subprocess.Popen(
            [sys.executable, "-c", f"from constrained.compile_pool import _worker_main; _worker_main({fd})"],
            pass_fds=(fd,),
            env=env,
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
        child_sock.close()  # only the worker holds its end: its death wakes a waiting poll() with EOF
        conn = Connection(parent_sock.detach())
        conn.send((self._vocab_blob, self.whitespace_pattern, self.memory_mb))
        # wait for the worker's imports: start-up is not compile time
        ready = conn.poll(STARTUP_TIMEOUT_S)
        try:
            reply = conn.recv() if ready else None
        except (EOFError, OSError):
            reply = None
        if reply != ("ready",):
            proc.kill()
            _reap(proc)
            conn.close()
            raise RuntimeError(f"grammar compile worker failed to start ({_how(proc)}; see the log)")
        with self._lock:
            if self._procs[slot] is not None:
                self.restarts += 1
            self._procs[slot] = proc
        return proc, conn

    def _kill(self, slot: int, proc: subprocess.Popen | None) -> None:
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()  # SIGKILL: a compile deep in Rust never checks for signals
        _reap(proc)


class _Breach:
    """A limit was hit: the worker must be killed and replaced, and the job fails with ``error``."""

    def __init__(self, error: Exception):
        self.error = error


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _how(proc: subprocess.Popen) -> str:
    code = proc.returncode
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _worker_main(fd: int) -> None:
    """Worker loop over the connection on ``fd``: first (vocabulary pickle, whitespace pattern, memory_mb),
    then (kind, spec) -> ("ok", regex, index, seconds) | ("error", message) | ("memory",)."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the server
    except OSError:
        pass
    try:
        import setproctitle

        setproctitle.setproctitle(PROC_TITLE)
    except ImportError:
        pass
    import pickle

    import outlines_core

    from constrained.errors import GrammarError
    from constrained.spec import validate_spec
    from constrained.vocab import END_MARKER_REGEX

    vocab_blob, whitespace_pattern, memory_mb = conn.recv()
    vocab = pickle.loads(vocab_blob)
    del vocab_blob
    # Address space, not RSS: the only limit the kernel enforces per process without cgroups. Measured from
    # here so imports (numpy, outlines-core: ~150-400 MB of mappings) do not eat the compile's budget.
    cap = _address_space_bytes() + memory_mb * (1 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    conn.send(("ready",))
    while True:
        try:
            kind, spec = conn.recv()
        except (EOFError, OSError):
            return  # the server closed the pipe
        start = time.perf_counter()
        try:
            regex = validate_spec(kind, spec, whitespace_pattern)
            try:
                index = outlines_core.Index(f"(?:{regex}){END_MARKER_REGEX}", vocab)
            except ValueError as err:  # validate_spec passed, so this is a vocabulary problem
                raise GrammarError(f"cannot compile {kind} for this tokenizer: {err}") from None
            reply = ("ok", regex, index, time.perf_counter() - start)
        except GrammarError as err:
            reply = ("error", str(err))
        except MemoryError:
            reply = ("memory",)
        except RecursionError:
            reply = ("error", f"{kind} is nested too deeply to compile")
        try:
            conn.send(reply)
        except MemoryError:  # pickling a huge Index can itself hit the cap
            conn.send(("memory",))
        del reply
