"""`radixlm serve --model FILE.gguf` with default flags, as a user starts it on a downloaded Qwen2.5 Q4_K_M
file (issue 49): a tiny random Qwen2 written by the test the way llama.cpp's converter writes one, with a
Q4_K_M-like type mix, stands in for it. The server resolves auto to gguf_native (the file's blocks in place),
takes the tokenizer and chat template from the file, serves completions and chat with speculation on, and
reuses its cache; a truncated file is refused at start-up with the reason and no traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import requests
from gguf import GGMLQuantizationType as Q

from tests.e2e.server_utils import ROOT, ServerProcess, free_port
from tests.unit.test_gguf_architectures import tiny_model, write_gguf
from tests.unit.test_gguf_native import Q4_K_M

# what `radixlm serve --model FILE` resolves with no flags (ServerProcess pins exact-test settings otherwise)
DEFAULT_FLAGS = ["--quantization", "auto", "--dtype", "auto", "--kv-cache-dtype", "auto"]
DEFAULT_FLAGS += ["--speculative-algorithm", "suffix"]


@pytest.fixture(scope="module")
def qwen2_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "qwen2-tiny-q4_k_m.gguf"
    write_gguf(
        path, tiny_model("qwen2", hidden_size=256, intermediate_size=512), "qwen2", qtype=Q.Q4_K, types=Q4_K_M
    )
    return path


@pytest.mark.slow  # a server start
def test_a_q4_k_m_file_serves_with_default_flags(qwen2_gguf: Path):
    srv = ServerProcess(model=str(qwen2_gguf), extra_args=DEFAULT_FLAGS).start()
    try:
        info = requests.get(srv.url + "/get_server_info", timeout=30).json()
        assert info["quantization"] == "gguf_native", info["quantization"]
        assert info["speculative_algorithm"] == "suffix"
        body = {"model": "default", "prompt": [1, 40, 90, 7, 200, 3] * 8, "max_tokens": 12, "temperature": 0}
        first = requests.post(srv.url + "/v1/completions", json=body, timeout=120).json()
        again = requests.post(srv.url + "/v1/completions", json=body, timeout=120).json()
        assert first["usage"]["completion_tokens"] >= 1
        assert again["choices"][0]["text"] == first["choices"][0]["text"]  # greedy: the same text twice
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the radix cache served it
        chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = requests.post(srv.url + "/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text  # the chat template came from the file
    finally:
        code = srv.stop()
    assert code == 0, srv.log_tail()


@pytest.mark.slow  # a server start that fails
def test_a_truncated_file_is_refused_at_start_up(qwen2_gguf: Path, tmp_path: Path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(qwen2_gguf.read_bytes()[: qwen2_gguf.stat().st_size * 2 // 3])
    cmd = [
        sys.executable,
        "-m",
        "runtime.launch_server",
        "--model",
        str(cut),
        "--port",
        str(free_port()),
        *DEFAULT_FLAGS,
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    log = out.stdout + out.stderr
    assert "cannot be served" in log and "Traceback" not in log, log[-2000:]
    assert "is truncated: tensor" in log or "is not a readable GGUF file (truncated or corrupt?)" in log
