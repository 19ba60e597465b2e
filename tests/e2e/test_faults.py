"""Fault injection on real server processes.

A dead scheduler or detokenizer must not leave clients hanging: in-flight requests fail within seconds
with a 503 that names the dead process, `/health` turns 503, and the server exits non-zero so a supervisor
restarts it (and no child outlives it). SIGTERM drains instead: new requests get 503, running ones finish,
exit code 0. Each test owns its server, since each ends it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.e2e.server_utils import ServerProcess, descendants

FAIL_FAST_S = 10.0  # kill -9 of a child -> the in-flight request's error reaches the client
EXIT_S = 15.0  # kill -9 of a child -> the server process has exited
LONG = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}  # never finishes during a test


def ipc_socket_owners(server_pid: int) -> dict[str, int]:
    """Map each bound ipc socket name ('scheduler', 'detokenizer', 'tokenizer') to the pid that holds it.

    The process trio's children all have the same multiprocessing command line, so they are told apart by
    the ipc:// socket each one binds: /proc/net/unix lists socket inodes with their paths, and a process's
    /proc/<pid>/fd links name the inodes it holds."""
    paths: dict[str, str] = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and "radixlm-ipc-" in fields[7]:
            paths[fields[6]] = fields[7]
    owners: dict[str, int] = {}
    for pid in [server_pid, *descendants(server_pid)]:
        for link in fd_links(pid):
            inode = link[len("socket:[") : -1] if link.startswith("socket:[") else None
            if inode in paths:
                owners.setdefault(os.path.basename(paths[inode]), pid)
    return owners


def fd_links(pid: int) -> list[str]:
    """Targets of a process's open file descriptors (fds closed while we look are skipped, not fatal)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    links = []
    for fd in fds:
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return links


def _stream_lines(url: str, body: dict, first_chunk: threading.Event, out: dict) -> None:
    """Read an SSE stream to its end, recording every `data:` payload and when the stream ended."""
    out["events"] = []
    try:
        with requests.post(
            url + "/generate", json={**body, "stream": True}, stream=True, timeout=(10, 120)
        ) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    out["events"].append(line[6:].decode())
                    first_chunk.set()
    except requests.RequestException as e:
        out["exception"] = repr(e)
    finally:
        out["ended"] = time.monotonic()
        first_chunk.set()


def _wait_running(url: str, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = requests.get(url + "/get_server_info", timeout=30).json()
        if info["num_running_reqs"] >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"{n} request(s) never started running")


def _health_after_death(url: str) -> tuple[int, str] | None:
    """/health's (status, body) if the server still answers; None once it has closed its socket."""
    try:
        r = requests.get(url + "/health", timeout=5)
    except requests.RequestException:
        return None
    return r.status_code, r.text


@pytest.mark.parametrize("victim", ["scheduler", "detokenizer"])
def test_child_killed_fails_inflight_requests_and_exits_nonzero(victim: str):
    srv = ServerProcess(extra_args=["--max-total-tokens", "10000"]).start()
    try:
        owners = ipc_socket_owners(srv.proc.pid)
        assert owners.get("tokenizer") == srv.proc.pid, owners
        assert {"scheduler", "detokenizer"} <= set(owners) and owners["scheduler"] != owners["detokenizer"], (
            owners
        )
        assert set(owners.values()) <= {srv.proc.pid, *srv.child_pids()}

        # A streaming request (we see it produce tokens) and a non-streaming one, both far from done.
        stream_out: dict = {}
        first = threading.Event()
        streamer = threading.Thread(
            target=_stream_lines,
            args=(srv.url, {"text": "Count to a thousand:", "sampling_params": LONG}, first, stream_out),
        )
        streamer.start()
        plain: dict = {}

        def post_plain() -> None:
            try:
                plain["resp"] = requests.post(
                    srv.url + "/generate",
                    timeout=120,
                    json={"text": "Write a long story.", "sampling_params": LONG},
                )
            except requests.RequestException as e:
                plain["exception"] = repr(e)
            plain["ended"] = time.monotonic()

        poster = threading.Thread(target=post_plain)
        poster.start()
        assert first.wait(120) and "exception" not in stream_out, stream_out
        _wait_running(srv.url, 2)

        os.kill(owners[victim], signal.SIGKILL)
        killed = time.monotonic()
        poster.join(60)
        streamer.join(60)
        assert not poster.is_alive() and not streamer.is_alive(), "a request hung after the kill"

        # The non-streaming request: a 503 naming the dead process, within seconds.
        assert "resp" in plain, plain
        assert plain["resp"].status_code == 503, plain["resp"].text
        message = plain["resp"].json()["error"]["message"]
        assert f"{victim} process died" in message, message
        assert plain["ended"] - killed < FAIL_FAST_S, f"took {plain['ended'] - killed:.1f}s to fail"

        # The stream had started (200 already sent): it ends with an error event, then [DONE].
        events = stream_out["events"]
        assert events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])
        assert "error" in err and f"{victim} process died" in err["error"]["message"], events[-2]
        assert stream_out["ended"] - killed < FAIL_FAST_S

        health = _health_after_death(srv.url)
        if health is not None:  # the server may already be gone; if it answers, it must say it is unhealthy
            assert health[0] == 503 and "unhealthy" in health[1], health

        code = srv.proc.wait(timeout=60)
        exited = time.monotonic() - killed
        assert code != 0, f"server exited 0 after its {victim} died"
        assert exited < EXIT_S, f"server took {exited:.1f}s to exit after its {victim} died"
        assert f"{victim} process died" in srv.log()
        print(f"\n{victim} killed: request failed after {plain['ended'] - killed:.2f}s, stream after "
              f"{stream_out['ended'] - killed:.2f}s, server exited {code} after {exited:.2f}s")  # fmt: skip
    finally:
        srv.stop()  # raises if a child process survived the server


@pytest.mark.parametrize("to_group", [False, True], ids=["to-server", "to-process-group"])
def test_sigterm_drains_running_requests_then_exits_zero(to_group, tmp_path):
    """SIGTERM to the server alone, or to its whole process group (kill -TERM -<pgid>, as shells and
    harnesses send it; with a disk tier the scheduler then has a SIGTERM handler of its own): either way the
    running request finishes before the server exits 0."""
    extra = ["--kv-disk-dir", str(tmp_path / "kv")] if to_group else []
    srv = ServerProcess(extra_args=["--max-total-tokens", "4096", *extra]).start()
    try:
        # Size the long request from the measured decode speed: it must outlast the checks below (a few
        # seconds) on a quiet machine and still finish in reasonable time on a loaded one.
        t0 = time.monotonic()
        warm = requests.post(
            srv.url + "/generate",
            timeout=300,
            json={
                "text": "Calibrate:",
                "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            },
        )
        assert warm.status_code == 200, warm.text
        rate = 8 / max(time.monotonic() - t0, 1e-3)
        n_tokens = int(min(max(rate * 6, 24), 400))

        out: dict = {}
        first = threading.Event()
        body = {
            "text": "Tell me about the sea.",
            "sampling_params": {"max_new_tokens": n_tokens, "temperature": 0, "ignore_eos": True},
        }
        reader = threading.Thread(target=_stream_lines, args=(srv.url, body, first, out))
        reader.start()
        assert first.wait(120), "the long request never started"

        if to_group:
            os.killpg(srv.proc.pid, signal.SIGTERM)
        else:
            srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the signal is handled asynchronously
            rejected = requests.post(
                srv.url + "/generate",
                timeout=60,
                json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}},
            )
            if rejected.status_code != 200:
                break
        assert reader.is_alive(), (
            "the long request finished before the drain could be observed; raise n_tokens"
        )
        assert rejected.status_code == 503, rejected.text
        assert "shutting down" in rejected.json()["error"]["message"]
        assert rejected.headers.get("Retry-After"), rejected.headers
        health = requests.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and "shutting down" in health.text

        reader.join(600)
        assert out.get("status") == 200 and "exception" not in out, out
        assert out["events"][-1] == "[DONE]"
        final = json.loads(out["events"][-2])
        assert final["meta_info"]["completion_tokens"] == n_tokens, final["meta_info"]
        assert final["meta_info"]["finish_reason"]["type"] == "length"
        assert srv.proc.wait(timeout=60) == 0, srv.log_tail()
    finally:
        srv.stop()


def test_second_sigterm_stops_at_once():
    """launch_server's contract: 'a second SIGTERM or SIGINT stops at once', even with requests running."""
    srv = ServerProcess(extra_args=["--max-total-tokens", "8192"]).start()
    try:
        out: dict = {}
        first = threading.Event()
        body = {"text": "Count to a thousand:", "sampling_params": LONG}
        reader = threading.Thread(target=_stream_lines, args=(srv.url, body, first, out))
        reader.start()
        assert first.wait(120), "the long request never started"
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while requests.get(srv.url + "/health", timeout=10).status_code == 200:  # draining has begun
            assert time.monotonic() < deadline
            time.sleep(0.1)
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            srv.proc.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"server still running {EXIT_S:.0f}s after the second SIGTERM")
        reader.join(60)
        assert not reader.is_alive() and time.monotonic() - t0 < EXIT_S
    finally:
        srv.stop(grace_s=5)
