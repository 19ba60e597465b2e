"""Tensor parallelism through the real server: `--tp-size 2` on the CPU (gloo) against one process.

- greedy tokens of the default model (9 heads / 3 KV heads: split 2 + 1 KV heads) equal TP=1's, including a
  request that extends over a cached prefix, and no KV slot leaks;
- a --tp-size the model cannot be sharded over fails at start with the numbers, before loading weights;
- killing a worker rank makes the server exit non-zero instead of hanging;
- two "nodes" on this machine (--nnodes 2, a worker-only node 1 started like a real second machine) serve
  the TP=1 tokens, and when node 1 goes away node 0 notices through the failed collective and exits.
The two cores of the test machine make TP=2 slower than TP=1 here: these tests check correctness only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.e2e.server_utils import (
    DEFAULT_ENV,
    HTTP_TIMEOUT_S,
    ROOT,
    ServerProcess,
    ServerStartupError,
    assert_no_kv_leak,
    descendants,
    free_port,
    wait_idle,
)

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPTS = [
    "The capital of France is",
    "The capital of France is Paris. The capital of Germany is",  # extends over the first prompt's cache
    "def fibonacci(n):",
]
EXIT_S = 15.0


def _greedy(url: str) -> list[tuple[list[int], int]]:
    out = []
    for text in PROMPTS:  # one at a time, so the second one finds the first one's prefix cached
        r = requests.post(
            url + "/generate", json={"text": text, "sampling_params": GREEDY}, timeout=HTTP_TIMEOUT_S
        )
        assert r.status_code == 200, r.text
        body = r.json()
        out.append((body["output_ids"], body["meta_info"]["cached_tokens"]))
    return out


def _tp_rank_pids(server_pid: int) -> dict[str, int]:
    """Process titles radixlm::tp-rank-N (set by init_child) of the server's descendants."""
    pids = {}
    for pid in descendants(server_pid):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        if title.startswith("radixlm::tp-rank-"):
            pids[title.removeprefix("radixlm::")] = pid
    return pids


def test_tp2_greedy_tokens_equal_tp1_on_default_model():
    args = ["--max-total-tokens", "4096", "--attention-backend", "torch_native"]
    with ServerProcess(extra_args=args) as srv:
        want = _greedy(srv.url)
    with ServerProcess(extra_args=[*args, "--tp-size", "2"]) as srv:
        assert set(_tp_rank_pids(srv.proc.pid)) == {"tp-rank-1"}
        got = _greedy(srv.url)
        assert_no_kv_leak(wait_idle(srv.url))
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert got[1][1] > 0, "the second prompt should have reused the first one's cached prefix"


def test_tp_size_the_model_cannot_split_fails_fast():
    srv = ServerProcess(extra_args=["--tp-size", "4"], startup_timeout=120)
    with pytest.raises(ServerStartupError, match="exited with code") as e:
        srv.start()
    assert "--tp-size 4 cannot shard this model: its 3 KV heads" in str(e.value)
    assert not srv.alive() and srv.child_pids() == []


def test_killed_worker_rank_makes_the_server_exit(tiny_model_dir):
    srv = ServerProcess(model=tiny_model_dir, extra_args=["--tp-size", "2", "--max-total-tokens", "2048"])
    srv.start()
    try:
        r = requests.post(
            srv.url + "/generate", json={"input_ids": [1, 5, 9], "sampling_params": GREEDY}, timeout=60
        )
        assert r.status_code == 200, r.text
        victim = _tp_rank_pids(srv.proc.pid)["tp-rank-1"]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        code = srv.proc.wait(timeout=60)
        exited = time.monotonic() - killed
        assert code != 0, "server exited 0 after a tensor-parallel rank died"
        assert exited < EXIT_S, f"server took {exited:.1f}s to exit after its rank 1 died"
        assert "tp-rank-1 process died" in srv.log()
    finally:
        srv.stop()  # raises if a child process (rank 0 included) survived the server


def test_two_nodes_serve_and_a_lost_node_stops_the_server(tiny_model_dir, tmp_path):
    ids = {"input_ids": [1, 5, 9, 200, 31], "sampling_params": GREEDY}
    with ServerProcess(model=tiny_model_dir) as srv:
        want = requests.post(srv.url + "/generate", json=ids, timeout=60).json()["output_ids"]
    addr = f"tcp://127.0.0.1:{free_port()}"
    common = ["--model", tiny_model_dir, "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    common += [
        "--dtype",
        "float32",
        "--quantization",
        "none",
        "--kv-cache-dtype",
        "float32",
    ]  # as ServerProcess pins them for node 0
    log = open(tmp_path / "node1.log", "wb")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "runtime.launch_server", *common, "--node-rank", "1", "--log-level", "info"],
        cwd=ROOT,
        env={**os.environ, **DEFAULT_ENV},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    srv = ServerProcess(model=tiny_model_dir, extra_args=common[2:] + ["--node-rank", "0"])
    try:
        srv.start()
        assert _tp_rank_pids(srv.proc.pid) == {}  # rank 1 runs under node 1's process
        assert set(_tp_rank_pids(node1.pid)) == {"tp-rank-1"}
        got = requests.post(srv.url + "/generate", json=ids, timeout=60).json()["output_ids"]
        assert got == want
        node1.send_signal(signal.SIGTERM)  # node 1 stops its rank and exits cleanly
        assert node1.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()
        lost = time.monotonic()
        code = srv.proc.wait(timeout=120)  # rank 0's next collective (a heartbeat, <= 5 s) fails
        exited = time.monotonic() - lost
        assert code != 0 and exited < 60, (code, exited)
        assert "scheduler process died" in srv.log()
        print(f"\nnode 1 gone: node 0 exited {code} after {exited:.1f}s")
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait()
        log.close()
        srv.stop()
