"""What every radixlm child process does first: die with its parent and name itself for `ps`.

Used by the scheduler and detokenizer (through the Supervisor), the grammar checker, and any other helper
process, so that an operator reading `ps` sees `radixlm::scheduler` instead of three identical
`python -c from multiprocessing.spawn import spawn_main` lines.
"""

from __future__ import annotations

import ctypes
import os
import signal

import setproctitle

from runtime import allocator

TITLE_PREFIX = "radixlm::"
_PR_SET_PDEATHSIG = 1


def set_process_title(role: str) -> str:
    """Set this process's title (argv as shown by `ps` and /proc/<pid>/cmdline) to `radixlm::<role>`."""
    title = f"{TITLE_PREFIX}{role}"
    setproctitle.setproctitle(title)
    return title


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (no orphans even after kill -9)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not glibc Linux: the parent's shutdown still kills its children
        pass


def leave_process_group() -> None:
    """Move this process into a process group of its own, so a signal sent to the server's whole group
    (`kill -TERM -<pgid>`, a shell's job control, a benchmark harness) reaches only the parent, which then
    stops its children in order: a SIGTERM drains running requests (and, with --kv-disk-dir, gives the
    scheduler time to write its cache) instead of killing the scheduler under them. `die_with_parent` still
    guarantees no child outlives the server."""
    try:
        os.setpgid(0, 0)
    except OSError:  # already a group leader, or not permitted: the signal semantics are merely as before
        pass


def init_child(role: str) -> None:
    """The first call of a child process's entry function. It also applies $RADIXLM_MMAP_THRESHOLD, where
    set (`allocator.configure`)."""
    die_with_parent()
    leave_process_group()
    set_process_title(role)
    allocator.configure()
