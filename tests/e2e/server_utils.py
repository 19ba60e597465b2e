"""Start a real radixlm server as a subprocess for end-to-end tests, and stop it without leaving orphans.

`ServerProcess` runs `python -m runtime.launch_server` on a free 127.0.0.1 port in its own process group,
waits for `GET /health` to answer 200, and on `stop()` sends SIGTERM (the server drains, then exits),
escalates to SIGKILL of the whole group after a grace period, and asserts that none of the server's child
processes (scheduler, detokenizer, multiprocessing helpers) outlived it.

    with ServerProcess(extra_args=["--api-key", "secret"]) as srv:
        requests.get(srv.url + "/health")

Test modules under tests/e2e import it as `from tests.e2e.server_utils import ...` (pyproject's pytest
`pythonpath` puts the repository root on sys.path). The HTTP helpers at the end (`wait_idle`,
`assert_no_kv_leak`, ...) check the KV accounting invariant of DESIGN.md from outside.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = float(os.environ.get("RADIXLM_TEST_STARTUP_TIMEOUT", "300"))
HTTP_TIMEOUT_S = 120.0  # decode is slow on a loaded 2-core machine
DEFAULT_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- /proc helpers (no psutil) ---------------------------------------------------------------------------
def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgid, start time in clock ticks) of a live process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its closing ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[2]), int(fields[19])


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid` (children, grandchildren, ...)."""
    seen: list[int] = []
    todo = _children(pid)
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.append(p)
            todo += _children(p)
    return seen


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[1] == pgid and st[0] != "Z":
                out.append(int(name))
    return out


def _alive(pid: int, start: int) -> bool:
    """True if the process recorded as (pid, start time) still runs (guards against PID reuse)."""
    st = _stat(pid)
    return st is not None and st[2] == start and st[0] != "Z"


class ServerStartupError(RuntimeError):
    pass


class ServerProcess:
    """A radixlm server subprocess. `extra_args` are appended to the CLI; `env` overrides the environment."""

    def __init__(
        self,
        model: str = "default",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_level: str = "warning",
        startup_timeout: float = STARTUP_TIMEOUT_S,
    ):
        self.model = model
        self.extra_args = list(extra_args)
        self.env = {**os.environ, **DEFAULT_ENV, **(env or {})}
        self.log_level = log_level
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.returncode: int | None = None
        self._log_file = tempfile.NamedTemporaryFile(prefix="radixlm-server-", suffix=".log", delete=False)
        self._children: list[tuple[int, int]] = []  # (pid, start time) of the server's descendants
        self._final_log: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "runtime.launch_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            self.log_level,
            # exactness tests (batch composition, cache hits, transformers parity) assume float32 without
            # quantization and with float32 K/V; `auto` is w4a8 or bfloat16 on some CPUs
            # (runtime/models/quantization.py) and float16 K/V on the CPU.
            # No speculation either: stream-chunk and step tests assume one token per step
            # (tests/e2e/test_speculative_server.py starts its own speculating server).
            # extra_args may override them (argparse: last one wins).
            "--speculative-algorithm",
            "none",
            "--dtype",
            "float32",
            "--quantization",
            "none",
            "--kv-cache-dtype",
            "float32",
            *self.extra_args,
        ]

    def log(self) -> str:
        """Everything the server wrote to stdout and stderr so far."""
        if self._final_log is not None:
            return self._final_log
        return Path(self._log_file.name).read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> ServerProcess:
        for attempt in range(3):  # a free port can be taken between our probe and the server's bind
            self.port = free_port()
            log_start = len(self.log())
            self.proc = subprocess.Popen(
                self.command(),
                cwd=ROOT,
                env=self.env,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                self._wait_healthy()
                break
            except ServerStartupError:
                self._kill_group()
                if attempt < 2 and "address already in use" in self.log()[log_start:].lower():
                    continue
                self._close_log()
                raise
            except BaseException:  # interrupted or timed out by pytest: never leave the server behind
                self._kill_group()
                self._close_log()
                raise
        self._children = [(p, st[2]) for p in descendants(self.proc.pid) if (st := _stat(p)) is not None]
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise ServerStartupError(
                    f"server exited with code {code} during startup; log tail:\n{self.log_tail()}"
                )
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise ServerStartupError(
            f"server not healthy after {self.startup_timeout:.0f}s; log tail:\n{self.log_tail()}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def child_pids(self) -> list[int]:
        """PIDs of the server's descendants recorded at startup that still run."""
        return [p for p, start in self._children if _alive(p, start)]

    def stop(self, grace_s: float = 60.0, check_children: bool = True) -> int:
        """SIGTERM the server; SIGKILL its process group if it has not exited after `grace_s`.

        Returns the exit code (negative: killed by that signal). Raises AssertionError if a child process
        survives the server by more than a few seconds (they are killed first, so nothing leaks)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._kill_group()
        self.returncode = self.proc.wait()
        survivors = self._wait_children_gone(timeout=10.0)
        if survivors:
            self._kill_group()
            for pid in survivors:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        self._close_log()
        if check_children and survivors:
            raise AssertionError(
                f"child process(es) {survivors} of server pid {self.proc.pid} survived it; "
                f"log tail:\n{self.log_tail()}"
            )
        return self.returncode

    def _close_log(self) -> None:
        if self._final_log is None:
            self._log_file.close()
            self._final_log = self.log()
            Path(self._log_file.name).unlink(missing_ok=True)

    def _wait_children_gone(self, timeout: float) -> list[int]:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            left = sorted(set(self.child_pids()) | set(group_members(self.proc.pid)))
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def _kill_group(self) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- HTTP helpers shared by the e2e modules --------------------------------------------------------------
def generate(url: str, body: dict, status: int = 200) -> dict | list:
    """POST /generate with `body`; asserts the answer's status and returns its JSON."""
    r = requests.post(url + "/generate", json=body, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == status, r.text
    return r.json()


def server_info(url: str, headers: dict | None = None) -> dict:
    r = requests.get(url + "/get_server_info", headers=headers, timeout=HTTP_TIMEOUT_S)
    r.raise_for_status()
    return r.json()


def wait_idle(url: str, timeout: float = 30.0, headers: dict | None = None) -> dict:
    """Poll /get_server_info until no request runs, waits in the scheduler, or is in flight in the HTTP front
    end; return that snapshot (AssertionError on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(url, headers)
        busy = info["num_running_reqs"], info["num_queued_reqs"], info.get("requests_in_flight", 0)
        if busy == (0, 0, 0):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(
                f"server still busy after {timeout:.0f}s: running {busy[0]}, queued {busy[1]}, "
                f"in flight {busy[2]}"
            )
        time.sleep(0.25)


def kick(url: str, headers: dict | None = None) -> None:
    """Send a tiny prefill-only request: it makes the scheduler run a step (and flush pending outputs)."""
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}
    requests.post(url + "/generate", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)


def unstick(url: str, headers: dict | None = None) -> None:
    """Best-effort cleanup after a failed test left requests behind:
    abort everything (abort_all: an admin call when the server has --admin-api-key), flush outputs.
    """
    try:
        body = {"abort_all": True}
        requests.post(url + "/abort_request", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)
        kick(url, headers)
        wait_idle(url, timeout=30, headers=headers)
    except (requests.RequestException, AssertionError):
        pass


def assert_no_kv_leak(info: dict) -> None:
    """The accounting invariant of DESIGN.md, on an idle snapshot:
    every KV slot is free or held by the cache.
    """
    total = info["max_total_tokens"]
    assert info["free_slots"] + info["cache_tokens"] == total, (
        f"KV leak: free {info['free_slots']} + cache {info['cache_tokens']} != pool {total} "
        f"(request-held {info.get('request_held_tokens')})"
    )
    assert info.get("request_held_tokens", 0) == 0, info
