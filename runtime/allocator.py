"""The process's C heap: how large tensor buffers are placed, when freed memory goes back, what RSS is.

Why this exists. glibc's malloc raises its mmap threshold whenever an mmap'ed block is freed (dynamically, up
to 32 MB), so after the first few steps every tensor buffer below 32 MB (logits rows, sampler
temporaries: a verify step of 64 requests x 5 rows x 49k vocabulary is 63 MB in several pieces whose sizes
change every step) comes from the main heap. Long-lived small allocations (radix nodes, drafting indexes,
queued requests) land between them, so the heap top can never come back down and the freed holes rarely fit
the next step's sizes: under bursts of 1,000 concurrent requests with speculation on the scheduler grew by
~1.5 GB per burst (bench/burst.py), all of it free memory glibc kept (`malloc_trim` returned it).

Two cures were measured. A fixed mmap threshold of 4 MB (`configure`) gives every such buffer its own
mapping, unmapped when freed: growth fell to ~8 MB per 1,000 requests, but every step then faults in fresh
zeroed pages for its logits and sampler buffers, ~5 % of a batch-64 decode step. Trimming (`trim`, glibc's
`malloc_trim`: the free pages inside the heap go back, the heap keeps reusing its chunks) costs nothing per
step; the scheduler trims when it goes idle and whenever its RSS grew by `memory.TRIM_AFTER_BYTES` since the
last trim (`memory.MemoryGuard`). That is the default; `RADIXLM_MMAP_THRESHOLD` (bytes) fixes the threshold
as well, for a process whose peaks cannot wait for a trim.

Standard library only (ctypes); a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # mallopt parameter numbers (glibc's malloc.h)
MMAP_THRESHOLD = 0  # bytes; 0: glibc's dynamic threshold (see above), e.g. 4 << 20 for a fixed one


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name or "libc.so.6")
        lib.gnu_get_libc_version  # noqa: B018 - present in glibc only
    except (OSError, AttributeError):
        return None
    return lib


_LIBC = _glibc()


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )  # fmt: skip
    ]


def configure(mmap_threshold: int | None = None) -> bool:
    """Fix glibc's mmap threshold (which also ends its dynamic raising) to `mmap_threshold`, else
    $RADIXLM_MMAP_THRESHOLD, else MMAP_THRESHOLD. False (nothing done) where there is no glibc or it is 0."""
    if mmap_threshold is None:
        mmap_threshold = int(os.environ.get("RADIXLM_MMAP_THRESHOLD", MMAP_THRESHOLD))
    if _LIBC is None or mmap_threshold <= 0:
        return False
    return bool(_LIBC.mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)))


def trim() -> bool:
    """Give the heap's free pages back to the system (`malloc_trim(0)`); True when any were released."""
    if _LIBC is None:
        return False
    return bool(_LIBC.malloc_trim(0))


def heap_info() -> dict[str, int]:
    """The C heap, in bytes: `heap_bytes` obtained with brk/sbrk and arenas, `heap_in_use_bytes`,
    `heap_free_bytes` (held by malloc, not yet returned), `mmapped_bytes` (blocks with their own mapping).
    Walks the heap's bins: call it per report, not per step. Empty without mallinfo2 (glibc < 2.33)."""
    fn = getattr(_LIBC, "mallinfo2", None) if _LIBC is not None else None
    if fn is None:
        return {}
    fn.restype = _MallInfo2
    m = fn()
    return {
        "heap_bytes": m.arena,
        "heap_in_use_bytes": m.uordblks,
        "heap_free_bytes": m.fordblks,
        "mmapped_bytes": m.hblkhd,
    }


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident set size (one read of /proc/self/statm: a few µs); 0 where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def meminfo_bytes(field: str) -> int:
    """One /proc/meminfo figure (`MemTotal`, `MemAvailable`, ...) in bytes; 0 where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def total_memory_bytes() -> int:
    """The machine's memory (MemTotal), or 0 where /proc/meminfo is missing."""
    return meminfo_bytes("MemTotal")
