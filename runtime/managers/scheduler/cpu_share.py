"""How many torch threads the model may use now: fewer while other processes keep this process's CPUs busy.

Each parallel region of a forward (a matmul, an attention call: hundreds per step) ends when its slowest
thread does. With as many threads as CPUs and another process running on one of them, every region waits
for the thread the kernel descheduled, so a step does not take 2x as long but 3-7x: a decode step of 64
requests on the 2-core machine took 122 ms quiet and 401 ms with one busy-looping process beside it on 2
threads, 168 and 181 ms on 1 (`platform.auto_num_threads` has more figures). Under a burst of 1,000
streaming clients the server's own HTTP process and the clients are such processes: a burst bench's
throughput fell from ~450 to 12-20 tok/s for minutes while other work ran beside it.

So the scheduler process measures, every WINDOW_S while it steps, how many CPUs other processes used on the
CPUs it may run on (/proc/stat's busy ticks minus its own), and runs on the CPUs left to it: `threads =
int(cpus - others + SLACK)`, between 1 and the configured count, changed after two windows agree. Only
with --num-threads left to auto: an explicit count is the operator's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from runtime import platform

logger = logging.getLogger("radixlm.scheduler")

WINDOW_S = 1.0  # how often the share is measured (two /proc reads)
SLACK = 0.3  # another process using under this much of a CPU leaves the thread its CPU
AGREE = 2  # windows in a row that must ask for the same new count


class ThreadGovernor:
    """Sets torch's intra-op threads to the CPUs other processes leave free. `tick()` once per step."""

    def __init__(self, max_threads: int, set_threads: Callable[[int], None], clock=time.monotonic):
        self.max_threads = max_threads
        self.threads = max_threads
        self.cpus = platform.usable_cpus()
        self._set = set_threads
        self._clock = clock
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last: tuple[float, int, int] | None = None  # (time, busy ticks of our CPUs, our ticks)
        self._wanted, self._votes = max_threads, 0
        self.others = 0.0  # CPUs other processes used in the last window
        self.changes = 0

    def tick(self) -> None:
        now = self._clock()
        if self._last is not None and now - self._last[0] < WINDOW_S:
            return
        busy, ours = platform.cpu_busy_ticks(self.cpus), platform.process_cpu_ticks()
        if busy is None or ours is None:
            return
        last, self._last = self._last, (now, busy, ours)
        if last is None or now - last[0] > 4 * WINDOW_S:  # the first window, or after an idle spell
            return
        seconds = now - last[0]
        self.others = max(0.0, ((busy - last[1]) - (ours - last[2])) / self._hz / seconds)
        self.decide(self.others)

    def decide(self, others: float) -> None:
        """One window's measurement: `others` CPUs busy with other processes."""
        want = max(1, min(self.max_threads, int(len(self.cpus) - others + SLACK)))
        if want == self.threads:
            self._votes = 0
            return
        self._votes = self._votes + 1 if want == self._wanted else 1
        self._wanted = want
        if self._votes >= AGREE:
            logger.info(
                "other processes use %.1f of this process's %d CPUs: %d torch threads (was %d)",
                others,
                len(self.cpus),
                want,
                self.threads,
            )
            self._set(want)
            self.threads, self._votes = want, 0
            self.changes += 1

    def info(self) -> dict:
        return {
            "num_threads_now": self.threads,
            "num_threads_max": self.max_threads,
            "other_processes_cpus": round(self.others, 2),
            "num_threads_changes": self.changes,
        }
