"""Start-up to the first token: `radixlm serve` cold and warm, and the peers users would start instead.

Issue 28's targets are "<= 30 s warm, <= 120 s cold". A run launches each side, then asks for one token of
a short prompt every 0.25 s until one comes back; the figure is launch -> that first token (the model load,
the kernel builds, the HTTP stack and the first forward all count).

- `radixlm-cold`: `radixlm serve` (default flags) with `RADIXLM_CACHE_DIR` set to a new empty directory, so
  the bundled GGUF is converted again and every C++ kernel is compiled again, as on a fresh machine. The OS
  page cache and Python's bytecode caches stay warm, so a first start after boot can take longer.
- `radixlm-warm`: the same command again on the directory the cold start filled.
- `llama-server`, `vllm`: the peers installed by `make bench-peers`, started as in the other benchmarks
  (their own caches as they are: vLLM keeps its torch.compile cache under ~/.cache/vllm).

    python -m bench.startup                                   # radixlm cold + warm
    python -m bench.startup --sides radixlm-cold,radixlm-warm,llama-server,vllm --threads 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import common
from bench.harness.peers import check_installed, free_port, peer_spec

RADIXLM_SIDES = ("radixlm-cold", "radixlm-warm")
PEER_SIDES = ("llama-server", "vllm")
POLL_S = 0.25


def first_token(url: str, model: str, deadline: float, proc: subprocess.Popen, log: Path) -> float:
    """Poll one-token completions until one succeeds; returns the monotonic time it came back."""
    import requests

    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before its first token; see {log}")
        try:
            r = requests.post(url + "/v1/completions", json=body, timeout=30)
            if r.status_code == 200 and r.json().get("choices"):
                return time.monotonic()
        except requests.RequestException:
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"no first token within the time limit; see {log}")


def stop(proc: subprocess.Popen) -> None:
    """End the side's whole process group (SIGTERM, then SIGKILL after 20 s)."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, 15)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


def measure(name: str, cmd: list[str], env: dict[str, str], model: str, port: int, timeout: float, log: Path):
    """One launch: seconds to the first token, and the command as it would be typed."""
    with open(log, "w") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=common.REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **env},
        )  # fmt: skip
        try:
            t1 = first_token(f"http://127.0.0.1:{port}", model, t0 + timeout, proc, log)
        finally:
            stop(proc)
    seconds = round(t1 - t0, 2)
    print(f"[startup] {name}: first token {seconds} s after launch", flush=True)
    typed = " ".join([*(f"{k}={v}" for k, v in env.items()), *cmd])
    return {"first_token_s": seconds, "command_line": typed}


def radixlm_cmd(port: int, threads: int) -> list[str]:
    import sys

    return [sys.executable, "-m", "runtime.entrypoints.cli", "serve", "--port", str(port),
            "--num-threads", str(threads)]  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    every = ",".join(RADIXLM_SIDES + PEER_SIDES)
    p.add_argument("--sides", default=",".join(RADIXLM_SIDES), help=f"of {every}")
    p.add_argument("--threads", type=int, default=common.usable_cores())
    p.add_argument("--timeout", type=float, default=900.0, help="per launch, seconds")
    p.add_argument("--name", default="startup")
    p.add_argument("--results-dir", default=None)
    args = p.parse_args(argv)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(sides) - set(RADIXLM_SIDES + PEER_SIDES))
    if unknown:
        p.error(f"--sides: unknown {unknown}; choose from {RADIXLM_SIDES + PEER_SIDES}")
    if "radixlm-warm" in sides and "radixlm-cold" not in sides:
        p.error("--sides: radixlm-warm reuses the directory radixlm-cold fills; name both")
    check_installed([s for s in sides if s in PEER_SIDES])
    logs = Path(args.results_dir or common.RESULTS_DIR)
    logs.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix="radixlm-startup-"))
    results: dict[str, Any] = {}
    try:
        for name in sides:
            port = free_port()
            log = logs / f"{args.name}_{name}.log"
            if name in RADIXLM_SIDES:
                env = {"RADIXLM_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
                results[name] = measure(name, radixlm_cmd(port, args.threads), env, "default", port,
                                        args.timeout, log)  # fmt: skip
            else:
                spec = peer_spec(name, port, args.threads)
                results[name] = {
                    **measure(name, spec.command, spec.env, spec.model, port, args.timeout, log),
                    "version": spec.version,
                }
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    config = {"sides": sides, "threads": args.threads, "poll_s": POLL_S}
    common.write_results(args.name, config, results, results_dir=args.results_dir)
    return results


if __name__ == "__main__":
    main()
