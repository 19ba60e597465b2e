"""Supervisor start-up failures: a clear error naming the child, and no child left running."""

from __future__ import annotations

import asyncio

import pytest

from runtime import ipc
from runtime.managers.tokenizer.supervisor import Supervisor
from runtime.server_args import ServerArgs


@pytest.fixture
def endpoints():
    ep = ipc.IpcEndpoints.create()
    yield ep
    ep.cleanup()


def test_child_that_fails_to_start_is_reported_and_reaped(endpoints, tmp_path):
    sup = Supervisor(ServerArgs(log_level="error"), str(tmp_path / "no-model-here"), endpoints)
    with pytest.raises(RuntimeError, match="scheduler process failed to start") as e:
        sup.start()
    assert "Traceback" in str(e.value)  # the child's traceback travels with the error
    assert set(sup.procs) == {"scheduler", "detokenizer"}
    assert all(not p.is_alive() for p in sup.procs.values())


def test_watch_reports_the_first_dead_child_once(endpoints, tmp_path):
    sup = Supervisor(ServerArgs(log_level="error"), str(tmp_path / "no-model-here"), endpoints)
    with pytest.raises(RuntimeError):
        sup.start()  # leaves two dead children: enough to exercise the watcher
    reasons: list[str] = []
    asyncio.run(asyncio.wait_for(sup.watch(reasons.append, interval_s=0.01), timeout=5))
    assert len(reasons) == 1 and reasons[0].startswith("scheduler process died (exit code")
