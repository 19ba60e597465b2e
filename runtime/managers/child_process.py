"""What every radixlm child process does first: die with its parent and name itself for `ps`.

Used by the scheduler and detokenizer (through the Supervisor), the grammar checker, and any other helper
process, so that an operator reading `ps` sees `radixlm::scheduler` instead of three identical
`python -c from multiprocessing.spawn import spawn_main` lines.
"""

from __future__ import annotations

import ctypes
import signal

import setproctitle

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


def init_child(role: str) -> None:
    """The first call of a child process's entry function."""
    die_with_parent()
    set_process_title(role)
