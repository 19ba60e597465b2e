"""--num-threads: auto resolves to the CPUs this process may use; explicit values are kept or rejected."""

import os

import pytest

from runtime.platform import auto_num_threads
from runtime.server_args import ServerArgs


def test_auto_threads_follow_affinity():
    n = auto_num_threads()
    assert 1 <= n <= len(os.sched_getaffinity(0))
    assert ServerArgs(device="cpu").resolve().num_threads == n


def test_auto_threads_shrink_with_affinity():
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert auto_num_threads() == 1
    finally:
        os.sched_setaffinity(0, before)


def test_explicit_threads_kept_and_checked():
    assert ServerArgs(device="cpu", num_threads=3).resolve().num_threads == 3
    with pytest.raises(ValueError, match="--num-threads"):
        ServerArgs(num_threads=0)
