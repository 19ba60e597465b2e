"""Peak resident memory of this process and its children (compile workers, an Engine's processes)."""

from __future__ import annotations

import os
import threading


def tree_rss_mb(pid: int) -> float:
    """Summed RSS of ``pid`` and all its descendants (compile workers, the Engine's processes), in MB."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, todo = {pid}, [pid]
    while todo:
        cur = todo.pop()
        for child, ppid in parent.items():
            if ppid == cur and child not in tree:
                tree.add(child)
                todo.append(child)
    total_kb = 0
    for p in tree:
        try:
            with open(f"/proc/{p}/status") as f:
                total_kb += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total_kb / 1024


class PeakRss:
    """Samples ``tree_rss_mb(os.getpid())`` every 0.2 s on a thread while in use; ``peak_mb`` after."""

    def __init__(self) -> None:
        self.peak_mb = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak_mb = max(self.peak_mb, tree_rss_mb(os.getpid()))
            self._done.wait(0.2)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
