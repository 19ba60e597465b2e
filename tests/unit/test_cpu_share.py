"""The scheduler's thread governor: torch threads follow the CPUs other processes leave free, changing only
after two windows agree, never below 1 or above the configured count; and the /proc readings it uses."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from runtime import platform
from runtime.managers.scheduler.cpu_share import WINDOW_S, ThreadGovernor


def governor(cpus: int = 2) -> tuple[ThreadGovernor, list[int]]:
    calls: list[int] = []
    gov = ThreadGovernor(cpus, calls.append)
    gov.cpus = list(range(cpus))
    return gov, calls


def test_threads_drop_while_another_process_takes_a_cpu_and_come_back():
    gov, calls = governor(2)
    gov.decide(1.0)  # one window: not yet
    assert gov.threads == 2 and calls == []
    gov.decide(0.9)
    assert gov.threads == 1 and calls == [1]
    gov.decide(0.1)
    gov.decide(0.9)  # the windows disagree: no change
    assert gov.threads == 1
    gov.decide(0.2)
    gov.decide(0.0)
    assert gov.threads == 2 and calls == [1, 2] and gov.changes == 2


def test_bounds_and_partial_load():
    gov, calls = governor(4)
    for _ in range(2):
        gov.decide(6.0)  # more load than CPUs: still one thread
    assert gov.threads == 1
    for _ in range(2):
        gov.decide(1.5)  # 2.5 CPUs free: 2 threads (a CPU 3/4 free is not counted)
    assert gov.threads == 2
    for _ in range(2):
        gov.decide(0.25)  # a quarter of a CPU taken: all four (SLACK)
    assert calls == [1, 2, 4]
    assert gov.info()["num_threads_now"] == 4 and gov.info()["num_threads_max"] == 4


def test_proc_readings_move_with_work():
    cpus = platform.usable_cpus()
    assert cpus
    busy0, ours0 = platform.cpu_busy_ticks(cpus), platform.process_cpu_ticks()
    if busy0 is None or ours0 is None:
        pytest.skip("no /proc")
    end = time.monotonic() + 0.3
    while time.monotonic() < end:  # 0.3 s of this process's CPU: ~30 ticks
        pass
    busy1, ours1 = platform.cpu_busy_ticks(cpus), platform.process_cpu_ticks()
    assert ours1 - ours0 >= 10 and busy1 - busy0 >= ours1 - ours0 - 5


@pytest.mark.skipif(len(platform.usable_cpus()) < 2, reason="needs two CPUs")
def test_tick_measures_a_busy_neighbour():
    """A real busy-looping process on a 2-CPU share: the governor sees about one CPU taken."""
    now = [0.0]
    calls: list[int] = []
    gov = ThreadGovernor(2, calls.append, clock=lambda: now[0])
    gov.cpus = platform.usable_cpus()[:2]
    first = gov.cpus[0]
    hog = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {first})
    )
    try:
        for _ in range(3):
            gov.tick()
            time.sleep(WINDOW_S)
            now[0] += WINDOW_S
    finally:
        hog.kill()
        hog.wait()
    assert gov.others > 0.5
    assert calls == [1]
