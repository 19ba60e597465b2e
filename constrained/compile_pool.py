"""The grammar sandbox: checks and compiles in worker processes, each capped in memory and in compile time.

outlines-core's Index construction can need tens of GB and minutes for an innocent-looking schema (a 1 KB
schema with ``maxLength: 8192`` strings took a scheduler to 23 GB and the OOM killer). A thread cannot be
stopped nor its memory bounded, so every job runs in a worker process. One implementation serves both users:
the HTTP process checks specs (``check=True``: ``validate_spec`` only, no vocabulary) and the scheduler
compiles them (the Index over the model's vocabulary). Limits are parameters (the server passes its
ServerArgs: --grammar-workers, --grammar-memory-mb, --grammar-timeout-s, --grammar-queue-size):

* memory: the worker sets RLIMIT_AS to (its address space after start-up) + ``memory_mb``; an allocation past
  it fails inside the worker (a Python MemoryError, or a Rust allocation abort), never in the caller;
* time: the clock starts when a worker takes the job (queue wait is not counted); past ``timeout_s`` the
  worker is SIGKILLed, so a timed-out compile stops consuming CPU at once (``GrammarTimeout``);
* queue: at most ``queue_size`` jobs wait for a worker; one more fails at once with ``GrammarUnavailable``
  (HTTP 503). A job cancelled (``future.cancel()``) before a worker takes it leaves the queue at once;
* a breached or crashed worker is replaced on the next job. A death by SIGABRT/SIGSEGV (what an allocation
  past RLIMIT_AS ends in) is the spec's fault (GrammarError naming the memory limit); any other death
  (SIGKILL from the OOM killer, say) is transient (GrammarUnavailable);
* the Index comes back pickled through the pipe (outlines-core's ``__reduce__``: a flat serialization of the
  transition table, ~10-30 ms for a large schema); its pickled size is reported as the entry's size estimate
  for the compiled-grammar cache, which lives in the caller (``grammar_cache``), so it survives restarts.

Workers are plain ``python -c`` subprocesses talking over a socketpair wrapped as a multiprocessing
``Connection``, not ``multiprocessing`` spawns: a spawn re-runs the parent's main script (a server entry point
or pytest, pulling in torch: ~300 MB of address space inside the cap, and seconds of start-up). This module
imports only the standard library at the top for the same reason (see ``constrained/__init__``).
"""

from __future__ import annotations

import collections
import ctypes
import os
import pickle
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from constrained.errors import GrammarError, GrammarTimeout, GrammarUnavailable

STARTUP_TIMEOUT_S = 120.0  # a worker's imports (numpy, outlines-core): ~1 s, much more on a loaded machine
PROC_TITLE = "radixlm::grammar"
# a worker dying of these under RLIMIT_AS ran out of memory (Rust aborts on a failed allocation; a stack
# that cannot grow faults): the spec's fault, cached as a 400
_MEMORY_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)


@dataclass(frozen=True)
class CompileResult:
    """What a worker sends back for one job."""

    regex: str  # the backend's diagnostic text: the regex compiled, the grammar text ("" for a check)
    index: object  # the backend's payload (outlines: the Index, end marker included); None for a check
    seconds: float  # time inside the worker (the spec check and the compile)
    started: float = 0.0  # time.monotonic() when the worker began the job (system-wide clock)
    nbytes: int = 0  # size of the pickled reply: the cache's estimate of what the payload holds
    backend: str = "outlines"  # the constrained.backends name that checked / compiled it


class CompilePool:
    """``submit(kind, spec, backend=...)`` -> Future[CompileResult]; at most ``workers`` jobs run at once and
    at most ``queue_size`` wait. ``vocab=None``: a pool for checks only (``submit(..., check=True)``).

    The future fails with ``GrammarError`` (unusable spec, over the memory limit), ``GrammarTimeout`` (over
    the time limit) or ``GrammarUnavailable`` (queue full, worker crashed or failed to start, shut down).
    Thread-safe.
    """

    def __init__(
        self,
        vocab,  # constrained.vocab.TokenVocabulary, or None for a check-only pool
        whitespace_pattern: str,
        *,
        workers: int,
        memory_mb: int,
        timeout_s: float,
        queue_size: int,
    ):
        if workers < 1 or memory_mb < 16 or timeout_s <= 0 or queue_size < 1:
            raise ValueError(
                f"bad grammar pool limits: workers={workers} memory_mb={memory_mb} timeout_s={timeout_s} "
                f"queue_size={queue_size}"
            )
        # sent to every (re)started worker: the whole TokenVocabulary (backends build tokenizers from it)
        self._vocab_blob = pickle.dumps(vocab) if vocab is not None else None
        self.whitespace_pattern = whitespace_pattern
        self.memory_mb = memory_mb
        self.timeout_s = timeout_s
        self.queue_size = queue_size
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[str, str, bool, str, Future]] = collections.deque()
        self._procs: list[subprocess.Popen | None] = [None] * workers
        self._closed = False
        self.restarts = 0  # workers killed or found dead, then replaced
        self.rejected = 0  # jobs refused because the queue was full
        self.running = 0
        self._threads = [
            threading.Thread(target=self._slot, args=(i,), name=f"grammar-slot-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, kind: str, spec: str, check: bool = False, backend: str = "outlines") -> Future:
        """Queue one job for ``backend``: a constrained.backends name, or names joined by commas tried in
        order (``backends.run_chain``). ``check``: only the vocabulary-free check (the result's index is
        None). The result's ``backend`` is the one that took the job."""
        future: Future = Future()
        if not check and self._vocab_blob is None:
            raise ValueError("this grammar pool has no vocabulary: it can only check specs")
        with self._cond:
            if self._closed:
                error = GrammarUnavailable("the grammar pool is shut down")
            elif len(self._queue) >= self.queue_size:
                self.rejected += 1
                error = GrammarUnavailable(
                    f"too many grammars waiting to be {'checked' if check else 'compiled'} "
                    f"({len(self._queue)}, the limit of --grammar-queue-size): the server is busy, "
                    "retry later"
                )
            else:
                error = None
                self._queue.append((kind, spec, check, backend, future))
                self._cond.notify()
        if error is not None:
            future.set_exception(error)
            return future
        future.add_done_callback(self._discard_if_cancelled)
        return future

    def _discard_if_cancelled(self, future: Future) -> None:
        """A job cancelled before a worker took it leaves the queue now (its slot is free for another)."""
        if not future.cancelled():
            return
        with self._cond:
            for job in self._queue:
                if job[-1] is future:
                    self._queue.remove(job)
                    break

    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def worker_pids(self) -> list[int]:
        with self._cond:
            return [p.pid for p in self._procs if p is not None and p.poll() is None]

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "queued": len(self._queue),
                "running": self.running,
                "rejected": self.rejected,
                "worker_restarts": self.restarts,
            }

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            left = list(self._queue)  # jobs nobody will take
            self._queue.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        for *_, future in left:
            if future.set_running_or_notify_cancel():
                future.set_exception(GrammarUnavailable("the grammar pool is shut down"))

    # ---- one slot: a thread that owns (at most) one worker process ---------------------------------------
    # The slot thread starts its worker and lives as long as the pool: PR_SET_PDEATHSIG fires when the
    # *thread* that created the child exits, so workers must not be started from short-lived threads.
    def _slot(self, slot: int) -> None:
        proc, conn = None, None
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    break
                kind, spec, check, backend, future = self._queue.popleft()
                self.running += 1
            try:
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    if proc is None or proc.poll() is not None:
                        proc, conn = self._start(slot, conn)
                    outcome = self._run(proc, conn, kind, spec, check, backend)
                except Exception as err:  # a failed start (spawn error): report it, keep the slot alive
                    outcome = GrammarUnavailable(f"grammar worker unavailable: {err}")
                    proc = None
                if isinstance(outcome, _Breach):
                    self._kill(proc)
                    proc = None
                    outcome = outcome.error
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)
            finally:
                with self._cond:
                    self.running -= 1
        self._kill(proc)
        if conn is not None:
            conn.close()

    def _run(self, proc: subprocess.Popen, conn, kind: str, spec: str, check: bool, backend: str):
        what = "checking" if check else "compiling"
        conn.send((kind, spec, check, backend))
        # the compile clock starts here: the job waited in the queue until this worker was free
        if not conn.poll(self.timeout_s):
            return _Breach(
                GrammarTimeout(
                    f"{kind} is too complex: {what} it took longer than the limit of {self.timeout_s:g} s "
                    "(--grammar-timeout-s)"
                )
            )
        try:
            blob = conn.recv_bytes()
        except (EOFError, OSError):  # the worker died mid-job: an allocation abort past RLIMIT_AS, or worse
            _reap(proc)
            if proc.returncode is not None and -proc.returncode in _MEMORY_SIGNALS:
                detail = f"the worker died: {_how(proc)}"
                return _Breach(GrammarError(self._memory_message(kind, what, detail)))
            return _Breach(
                GrammarUnavailable(f"the grammar worker {what} the {kind} crashed ({_how(proc)}); retry")
            )
        reply = pickle.loads(blob)
        status = reply[0]
        if status == "ok":
            return CompileResult(
                regex=reply[1],
                index=reply[2],
                seconds=reply[3],
                started=reply[4],
                nbytes=len(blob),
                backend=reply[5],
            )
        if status == "memory":
            return _Breach(GrammarError(self._memory_message(kind, what, "out of memory")))
        return GrammarError(reply[1])

    def _memory_message(self, kind: str, what: str, detail: str) -> str:
        return (
            f"{kind} is too complex: {what} it needs more memory than the limit of {self.memory_mb} MB "
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
            raise RuntimeError(f"it failed to start ({_how(proc)}; see the log)")
        with self._cond:
            if self._procs[slot] is not None:
                self.restarts += 1
            self._procs[slot] = proc
        return proc, conn

    def _kill(self, proc: subprocess.Popen | None) -> None:
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
    """Worker loop over the connection on ``fd``: first (TokenVocabulary pickle or None, whitespace pattern,
    memory_mb), then (kind, spec, check, backends) -> ("ok", text, payload, seconds, started, backend) |
    ("error", message) | ("memory",)."""
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
    from constrained.backends import BACKEND_NAMES, get_backend, run_chain

    vocab_blob, whitespace_pattern, memory_mb = conn.recv()
    vocab = pickle.loads(vocab_blob) if vocab_blob is not None else None
    del vocab_blob
    for name in BACKEND_NAMES:  # imports and per-vocabulary tables before the cap: not a compile's budget
        try:
            get_backend(name).prepare(vocab)
        except GrammarError:
            pass  # not installed: a job for it fails with that message
    # Address space, not RSS: the only limit the kernel enforces per process without cgroups. Measured from
    # here so imports (numpy, outlines-core: ~150-400 MB of mappings) do not eat the compile's budget.
    cap = _address_space_bytes() + memory_mb * (1 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    conn.send(("ready",))
    while True:
        try:
            kind, spec, check, backend_name = conn.recv()
        except (EOFError, OSError):
            return  # the server closed the pipe
        started, start = time.monotonic(), time.perf_counter()
        try:
            name, text, payload = run_chain(backend_name, kind, spec, whitespace_pattern, vocab, check)
            reply = ("ok", "" if check else text, payload, time.perf_counter() - start, started, name)
        except GrammarError as err:
            reply = ("error", str(err))
        except MemoryError:
            reply = ("memory",)
        except RecursionError:
            reply = ("error", f"{kind} is nested too deeply to compile")
        try:
            conn.send(reply)
        except MemoryError:  # pickling a huge payload can itself hit the cap
            conn.send(("memory",))
        del reply
