"""Agent swarm under KV memory pressure: LRU vs session pins vs session pins + the host KV tier.

A agents each own a history (`--history-tokens` at the start) that grows every step by the model's output
and a tool result (`--growth-tokens`). A step is one native `/generate` of the whole history (token ids, so
lengths are exact; no two agents share a first token, so histories share nothing). Between steps the agent
waits for its "tool": a pause drawn from a log-normal with median `--pause-median-s` and 95th percentile
`--pause-p95-s` (heavy-tailed: median 1 s / p95 20 s by default). The server's KV pool is capped with
`--max-total-tokens` at `--pool-fraction` (1/3) of the working set (every agent's final history), which
emulates a GPU's memory pressure on the CPU: while an agent's tool runs, the others' steps evict its history.

Sides, one launched server each, the same seeded workload for all:
  lru            no session fields: today's LRU cache;
  sessions       each request names its agent's `session_id` with a `cache_ttl_s` above the longest pause,
                 `--max-pinned-tokens` = `--pinned-fraction` of the pool;
  sessions+host  the same plus `--kv-host-tier-gb` sized for the whole working set (x1.25);
  sessions+disk  sessions plus `--kv-disk-dir` (a fresh temporary directory; no host tier).

Figures per side: prefill tokens recomputed (sum of prompt_tokens - cached_tokens over all steps; the first
step of every agent is cold on every side and is counted too), cached tokens by tier, step latency p50 / p99
(one /generate, the tool pause excluded) and steps/s (all steps / wall time of the run, pauses included).

`--scale-down` (and `--quick`) shrink the run to fit a few minutes on a shared 2-core machine: 4 agents,
256-token histories growing by 32 + 8 tokens, 3 steps, pauses x0.1 (median 0.1 s, p95 2 s); the output and
the JSON say so.

    python -m bench.agent_swarm --scale-down
    python -m bench.agent_swarm --agents 24 --history-tokens 1500 --steps 8
"""

from __future__ import annotations

import math
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import common

SIDES = ("lru", "sessions", "sessions+host", "sessions+disk")
FP32_BYTES_PER_TOKEN = 46080  # SmolLM2-135M: 2 x 30 layers x 3 KV heads x 64 x 4 bytes


@dataclass
class AgentTrace:
    latencies: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    by_tier: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    error: str | None = None


def pause_sampler(median: float, p95: float, rng: random.Random):
    """Log-normal pauses with the given median and 95th percentile."""
    sigma = math.log(max(p95, median * 1.0001) / median) / 1.6449
    return lambda: rng.lognormvariate(math.log(median), sigma)


def plan(args) -> list[dict[str, Any]]:
    """Each agent's seeded workload: first history, the tool results of its steps, its pauses."""
    rng = random.Random(args.seed)
    pause = pause_sampler(args.pause_median_s * args.pause_scale, args.pause_p95_s * args.pause_scale, rng)
    agents = []
    for a in range(args.agents):
        first = [1000 + a] + [rng.randrange(2000, 40000) for _ in range(args.history_tokens - 1)]
        tools = [[rng.randrange(2000, 40000) for _ in range(args.growth_tokens)] for _ in range(args.steps)]
        pauses = [pause() for _ in range(args.steps)]
        agents.append({"history": first, "tools": tools, "pauses": pauses, "start": rng.uniform(0, 2.0)})
    return agents


def working_set(args) -> int:
    return args.agents * (args.history_tokens + args.steps * (args.growth_tokens + args.max_new_tokens))


def run_agent(url: str, side: str, agent: int, work: dict, args, trace: AgentTrace) -> None:
    import requests

    history = list(work["history"])
    time.sleep(work["start"])
    for step in range(args.steps):
        body: dict[str, Any] = {
            "input_ids": history,
            "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True},
        }
        if side != "lru":
            body["session_id"] = f"agent-{agent}"
            body["cache_ttl_s"] = args.session_ttl_s
        t0 = time.perf_counter()
        try:
            r = requests.post(url + "/generate", json=body, timeout=600)
            r.raise_for_status()
        except Exception as e:  # recorded; the run goes on with the other agents
            trace.error = f"step {step}: {e}"
            return
        trace.latencies.append(time.perf_counter() - t0)
        out = r.json()
        meta = out["meta_info"]
        trace.prompt_tokens += meta["prompt_tokens"]
        trace.cached_tokens += meta["cached_tokens"]
        for tier, n in (meta.get("cached_tokens_by_tier") or {}).items():
            trace.by_tier[tier] = trace.by_tier.get(tier, 0) + n
        history += out["output_ids"] + work["tools"][step]
        time.sleep(work["pauses"][step])


def side_flags(side: str, args, pool: int, disk_dir: str | None = None) -> list[str]:
    flags = ["--max-total-tokens", str(pool), "--dtype", args.dtype, "--log-level", "warning"]
    flags += ["--max-running-requests", str(args.agents)]
    if side != "lru":
        flags += ["--max-pinned-tokens", str(int(pool * args.pinned_fraction))]
    if side == "sessions+host":
        gb = working_set(args) * 1.25 * FP32_BYTES_PER_TOKEN / 2**30
        flags += ["--kv-host-tier-gb", f"{gb:.3f}"]
    if side == "sessions+disk":
        flags += ["--kv-disk-dir", disk_dir]
    return flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_side(side: str, args, pool: int) -> dict[str, Any]:
    import requests

    from bench.serving import LaunchedServer

    port = _free_port()
    disk_dir = tempfile.mkdtemp(prefix="radixlm-swarm-kv-") if side == "sessions+disk" else None
    flags = side_flags(side, args, pool, disk_dir)
    cmd = [sys.executable, "-m", "runtime.launch_server", "--port", str(port), *flags]
    log = Path(args.results_dir) / f"{args.name or 'agent_swarm'}_{side.replace('+', '_')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    server = LaunchedServer(cmd, port, log)
    try:
        work = plan(args)
        traces = [AgentTrace() for _ in work]
        threads = [
            threading.Thread(target=run_agent, args=(server.url, side, a, w, args, traces[a]), daemon=True)
            for a, w in enumerate(work)
        ]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        info = requests.get(server.url + "/get_server_info", timeout=30).json()
    finally:
        server.stop()
        if disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)
    lat = [x for t in traces for x in t.latencies]
    prompt = sum(t.prompt_tokens for t in traces)
    cached = sum(t.cached_tokens for t in traces)
    tiers = {k: sum(t.by_tier.get(k, 0) for t in traces) for k in ("device", "host", "disk")}
    return {
        "side": side,
        "command": " ".join(cmd[1:]),
        "steps": len(lat),
        "errors": [f"agent {i}: {t.error}" for i, t in enumerate(traces) if t.error],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_tokens_by_tier": tiers,
        "prefill_recomputed": prompt - cached,
        "step_latency_s": common.summarize(lat),
        "wall_s": wall,
        "steps_per_s": len(lat) / wall if wall else math.nan,
        "server": {
            k: info.get(k)
            for k in (
                "session_pins_pinned",
                "session_pins_evicted_for_limit",
                "session_pins_evicted_for_memory",
                "session_pins_demoted_to_host",
                "host_tier_tokens",
                "host_saved_tokens",
                "host_loaded_tokens",
                "host_dropped_tokens",
                "disk_written_blocks",
                "disk_loaded_tokens",
                "retractions",
            )
        },
    }


def main(argv: list[str] | None = None) -> None:
    p = common.base_parser(__doc__.split("\n")[0])
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    p.add_argument("--agents", type=int, default=24)
    p.add_argument("--history-tokens", type=int, default=1500, help="each agent's history at its first step")
    p.add_argument("--growth-tokens", type=int, default=64, help="tool result appended after each step")
    p.add_argument("--max-new-tokens", type=int, default=8, help="the model's output per step")
    p.add_argument("--steps", type=int, default=6, help="steps per agent")
    p.add_argument("--pause-median-s", type=float, default=1.0)
    p.add_argument("--pause-p95-s", type=float, default=20.0)
    p.add_argument("--pause-scale", type=float, default=1.0, help="multiplies every pause")
    p.add_argument("--pool-fraction", type=float, default=1 / 3, help="KV pool / working set")
    p.add_argument("--pinned-fraction", type=float, default=0.75, help="--max-pinned-tokens / KV pool")
    p.add_argument("--session-ttl-s", type=float, default=120.0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--scale-down",
        action="store_true",
        help="fit a few minutes on a shared 2-core CPU: 4 agents, 256-token histories, 3 steps, pauses x0.1",
    )
    args = p.parse_args(argv)
    common.setup_env()
    if args.scale_down or args.quick:
        args.agents, args.history_tokens, args.steps, args.pause_scale = 4, 256, 3, 0.1
        args.growth_tokens = 32
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    bad = [s for s in sides if s not in SIDES]
    if bad:
        p.error(f"unknown side(s) {bad}; known: {', '.join(SIDES)}")
    ws = working_set(args)
    pool = max(256, int(ws * args.pool_fraction))
    scaled = args.agents != 24 or args.pause_scale != 1.0 or args.history_tokens != 1500
    note = (
        f"{args.agents} agents, {args.history_tokens}-token histories, {args.steps} steps, pauses median "
        f"{args.pause_median_s * args.pause_scale:.2f} s / p95 {args.pause_p95_s * args.pause_scale:.1f} s"
        + (" (SCALED DOWN from the issue's 24 agents, 1.5k tokens, 1 s / 20 s)" if scaled else "")
        + f"; working set {ws} tokens, KV pool {pool} tokens"
    )
    print(note, flush=True)
    env = common.environment()
    results = []
    for side in sides:
        res = run_side(side, args, pool)
        results.append(res)
        print(
            f"{side}: recomputed {res['prefill_recomputed']} of {res['prompt_tokens']} prompt tokens, "
            f"cached by tier {res['cached_tokens_by_tier']}, step p50 {res['step_latency_s']['p50']:.2f} s "
            f"p99 {res['step_latency_s']['p99']:.2f} s, {res['steps_per_s']:.2f} steps/s, "
            f"errors {len(res['errors'])}",
            flush=True,
        )
    lru = next((r for r in results if r["side"] == "lru"), None)
    rows = []
    for r in results:
        rows.append(
            {
                "side": r["side"],
                "recomputed": r["prefill_recomputed"],
                "vs LRU": common.ratio(r["prefill_recomputed"], lru and lru["prefill_recomputed"]),
                "host hit": r["cached_tokens_by_tier"]["host"],
                "p50 s": r["step_latency_s"]["p50"],
                "p99 s": r["step_latency_s"]["p99"],
                "p99 vs LRU": common.ratio(r["step_latency_s"]["p99"], lru and lru["step_latency_s"]["p99"]),
                "steps/s": r["steps_per_s"],
            }
        )
    common.print_table(rows, list(rows[0]) if rows else [], "agent swarm")
    config = {**vars(args), "command": common.command_line(), "note": note, "working_set": ws, "pool": pool}
    common.write_results(
        args.name or "agent_swarm", config, {"sides": results, "table": rows}, env, args.results_dir
    )


if __name__ == "__main__":
    main()
