"""Agent swarm under KV memory pressure: LRU vs session pins vs pins + host or disk KV tier; a restart.

A agents each own a history (`--history-tokens` at the start) that grows every step by the model's output
and a tool result (`--growth-tokens`). A step is one native `/generate` of the whole history (token ids, so
lengths are exact; no two agents share a first token, so histories share nothing). Between steps the agent
waits for its "tool": a pause drawn from a log-normal with median `--pause-median-s` and 95th percentile
`--pause-p95-s` (heavy-tailed: median 1 s / p95 20 s by default). The server's KV pool is capped with
`--max-total-tokens` at `--pool-fraction` (1/3) of the working set (every agent's final history), which
emulates a GPU's memory pressure on the CPU: while an agent's tool runs, the others' steps evict its history.

Sides, one launched server each, the same seeded workload for all:
  lru            no session fields: today's LRU cache;
  sessions       each request names its agent's `session_id` with a `cache_ttl_s` above the longest pause
                 (`--session-ttl-s`; by default the longest planned pause + 120 s for queueing),
                 `--max-pinned-tokens` = `--pinned-fraction` of the pool;
  sessions+host  the same plus `--kv-host-tier-gb` sized for the whole working set (x1.25);
  sessions+disk  sessions plus `--kv-disk-dir` (a fresh temporary directory; no host tier).

Figures per side: the prefill, from each step's prompt_tokens P and cached_tokens C and the tokens B of the
prompt that the server had already computed for that agent (`computed_before`: the prompt's common prefix
with the agent's previous prompt + output, less that output's last token, which never gets KV, and less the
prompt's last token, whose logits every request computes; exact, as the bench sends token ids):
  prefill_total       sum of P - C (every prompt token computed, the first steps' cold prefill included);
  prefill_new         sum of P - max(B, C) (tokens the server had never computed for that agent: each
                      agent's first prompt, then each step's new output + tool result);
  prefill_recomputed  sum of max(0, B - C) (tokens computed before and lost to eviction, expiry or a
                      tier that could not serve them): the issue's "prefill tokens recomputed".
prefill_total = prefill_new + prefill_recomputed. Also: cached tokens by tier, step latency p50 / p99 (one
/generate, the tool pause excluded), steps/s (all steps / wall time of the run, pauses included), and per
agent each step's P, C, B, tiers and the server's `cache_miss` reason (session sides).

Restart (after sessions+disk, unless `--no-restart`): that server gets a SIGTERM (it writes its cache to the
disk directory, up to the supervisor's 60 s), a new one starts with the same flags and `--kv-disk-dir`, and
each agent's next step (its final history: its last prompt, that step's output, the last tool result) is
replayed once, sequentially, with max_new_tokens 1; its latency is the TTFT. A cold server (same flags, an
empty directory) gets the same replays. Both serve one short unrelated warm-up request first.

Targets (the issue's, for each sessions side against lru): prefill recomputed <= 0.2x LRU's; step p99 <= 0.5x
LRU's over the steps that follow a tool pause (each agent's first step is the cold prefill of the history it
starts with, which no cache can serve; their burst sets every side's overall p99 alike, so the overall p99
is reported beside the target, not judged); after the restart, TTFT p50 <= 0.3x the cold server's.
They are met or not in the table and the JSON.

`--scale-down` (and `--quick`) shrink the run to fit a few minutes on a shared 2-core machine: 4 agents,
256-token histories growing by 32 + 8 tokens, 3 steps, pauses x0.1 (median 0.1 s, p95 2 s), so the restart
replays ~380-token prompts, not the issue's 2k-token prefix; the output and the JSON say so.

    python -m bench.agent_swarm --scale-down
    python -m bench.agent_swarm --agents 24 --history-tokens 1500 --steps 6
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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import common

SIDES = ("lru", "sessions", "sessions+host", "sessions+disk")
FP32_BYTES_PER_TOKEN = 46080  # SmolLM2-135M: 2 x 30 layers x 3 KV heads x 64 x 4 bytes
RECOMPUTED_TARGET = 0.2  # prefill recomputed / LRU's
P99_TARGET = 0.5  # step latency p99 / LRU's
RESTART_TARGET = 0.3  # TTFT p50 after the restart / a cold server's
STOP_TIMEOUT_S = 150.0  # SIGTERM to SIGKILL: the supervisor gives the scheduler 60 s to write the cache
WARM_UP_IDS = [999] + [2000 + 7 * i for i in range(95)]  # no agent starts with 999: shares no cached block


@dataclass
class AgentTrace:
    latencies: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    by_tier: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    error: str | None = None
    history: list[int] = field(default_factory=list)  # what its next step sends (the restart replays it)
    steps: list[dict[str, Any]] = field(default_factory=list)  # per step: `step_record`'s


def computed_before(previous: Sequence[int] | None, prompt: Sequence[int]) -> int:
    """Tokens of `prompt` whose KV the server computed for this agent's previous step (`previous`: that
    step's prompt + output; None for a first step): their common prefix, less the output's last token
    (sampled, never fed back: it has no KV) and never the prompt's last token (its logits are always
    computed). The server's cache-miss explainer calls the same figure `expected_cached_tokens`."""
    if not previous:
        return 0
    n = min(len(previous), len(prompt))
    common = next((i for i in range(n) if previous[i] != prompt[i]), n)
    return max(0, min(common, len(previous) - 1, len(prompt) - 1))


def step_record(meta: dict[str, Any], before: int) -> dict[str, Any]:
    """One step's cache figures from its response's meta_info and `computed_before`."""
    tiers = meta.get("cached_tokens_by_tier") or {}
    miss = meta.get("cache_miss")
    return {
        "prompt_tokens": meta["prompt_tokens"],
        "cached_tokens": meta["cached_tokens"],
        "computed_before": before,
        "host": tiers.get("host", 0),
        "disk": tiers.get("disk", 0),
        "miss": miss.get("reason") if miss else None,
    }


def prefill_accounting(steps: Iterable[dict[str, Any]]) -> dict[str, int]:
    """prefill_total / prefill_new / prefill_recomputed over step records (see the module docstring), and the
    recomputed tokens by the server's cache_miss reason ("none": the server named none, e.g. no session)."""
    total = new = recomputed = 0
    by_reason: dict[str, int] = {}
    for s in steps:
        p, c, b = s["prompt_tokens"], s["cached_tokens"], s["computed_before"]
        lost = max(0, b - c)
        total += p - c
        new += p - max(b, c)
        recomputed += lost
        if lost:
            reason = s.get("miss") or "none"
            by_reason[reason] = by_reason.get(reason, 0) + lost
    return {
        "prefill_total": total,
        "prefill_new": new,
        "prefill_recomputed": recomputed,
        "recomputed_by_reason": by_reason,
    }


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


def default_ttl(args) -> float:
    """The sessions' cache_ttl_s: the longest pause between two steps of the seeded plan, plus 120 s for the
    time the next step may wait in the server's queue (a pin's TTL runs from the previous step's end)."""
    pauses = [p for w in plan(args) for p in w["pauses"][:-1]]
    return math.ceil(max(pauses, default=0.0)) + 120.0


def working_set(args) -> int:
    return args.agents * (args.history_tokens + args.steps * (args.growth_tokens + args.max_new_tokens))


def request_body(side: str, agent: int, ids: list[int], max_new_tokens: int, ttl_s: float) -> dict[str, Any]:
    """One agent step's native /generate body; the sessions sides name the agent's session."""
    body: dict[str, Any] = {
        "input_ids": list(ids),
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    if side != "lru":
        body["session_id"] = f"agent-{agent}"
        body["cache_ttl_s"] = ttl_s
    return body


def run_agent(url: str, side: str, agent: int, work: dict, args, trace: AgentTrace) -> None:
    import requests

    history = trace.history = list(work["history"])
    previous: list[int] | None = None  # the last step's prompt + output
    time.sleep(work["start"])
    for step in range(args.steps):
        body = request_body(side, agent, history, args.max_new_tokens, args.session_ttl_s)
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
        trace.steps.append(step_record(meta, computed_before(previous, history)))
        history += out["output_ids"]
        previous = list(history)
        history += work["tools"][step]
        if step + 1 < args.steps:  # the last tool's pause delays nothing
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


def launch(side: str, args, pool: int, disk_dir: str | None, tag: str):
    """A server for `side` on a free port, logging to <results-dir>/<name>_<tag>.log; (server, command)."""
    from bench.serving import LaunchedServer

    port = _free_port()
    cmd = [sys.executable, "-m", "runtime.launch_server", "--port", str(port)]
    cmd += side_flags(side, args, pool, disk_dir)
    log = Path(args.results_dir) / f"{args.name or 'agent_swarm'}_{tag.replace('+', '_')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    return LaunchedServer(cmd, port, log), cmd


def server_info(url: str) -> dict[str, Any]:
    import requests

    return requests.get(url + "/get_server_info", timeout=30).json()


def run_side(
    side: str, args, pool: int, keep_disk: bool = False
) -> tuple[dict[str, Any], list[AgentTrace], str | None]:
    """One side's run: (figures, the agents' traces, the disk directory when `keep_disk`, else None). The
    server is stopped with SIGTERM and STOP_TIMEOUT_S, so a disk side writes its cache before it exits."""
    disk_dir = tempfile.mkdtemp(prefix="radixlm-swarm-kv-") if side == "sessions+disk" else None
    server, done = None, False
    try:
        server, cmd = launch(side, args, pool, disk_dir, side)
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
        info = server_info(server.url)
        done = True
    finally:
        if server is not None:
            server.stop(timeout_s=STOP_TIMEOUT_S)
        if disk_dir and not (keep_disk and done):
            shutil.rmtree(disk_dir, ignore_errors=True)
    lat = [x for t in traces for x in t.latencies]
    prompt = sum(t.prompt_tokens for t in traces)
    cached = sum(t.cached_tokens for t in traces)
    tiers = {k: sum(t.by_tier.get(k, 0) for t in traces) for k in ("device", "host", "disk")}
    res = {
        "side": side,
        "command": " ".join(cmd[1:]),
        "steps": len(lat),
        "errors": [f"agent {i}: {t.error}" for i, t in enumerate(traces) if t.error],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_tokens_by_tier": tiers,
        **prefill_accounting(s for t in traces for s in t.steps),
        "first_step_prompt_tokens": sum(len(w["history"]) for w in work),  # cold on every side
        "steps_by_agent": [t.steps for t in traces],
        "step_latency_s": common.summarize(lat),
        # every agent's first step is a cold prefill on every side, all of them in the first seconds: on a
        # small CPU that burst alone sets the p99, so the later steps are summarised apart
        "later_step_latency_s": common.summarize([x for t in traces for x in t.latencies[1:]]),
        "latencies_by_agent_s": [[round(x, 4) for x in t.latencies] for t in traces],
        "wall_s": wall,
        "steps_per_s": len(lat) / wall if wall else math.nan,
        # SIGTERM goes to the whole group, so the children exit too and the launcher answers 0, or 1 when it
        # sees them gone before its own drain ends; the restart's disk_files_at_start shows what was saved
        "stop_exit_code": server.proc.returncode,
        "server": {
            k: info.get(k)
            for k in (
                "session_pins_pinned",
                "session_pins_evicted_for_limit",
                "session_pins_evicted_for_memory",
                "session_pins_expired",
                "session_pins_demoted_to_host",
                "host_tier_tokens",
                "host_saved_tokens",
                "host_loaded_tokens",
                "host_dropped_tokens",
                "disk_written_blocks",
                "disk_loaded_tokens",
                "disk_dropped",
                "disk_evicted",
                "retractions",
                "tier_load_waits",
                "tier_tokens_recomputed",
            )
        },
    }
    return res, traces, disk_dir if keep_disk else None


# ---- restart -----------------------------------------------------------------------------------------
def replay_bodies(
    traces: list[AgentTrace], side: str, ttl_s: float
) -> tuple[list[tuple[int, dict]], list[int]]:
    """Each agent's next step, max_new_tokens 1: ([(agent, body)], agents left out because a step failed
    and their history is not the one the run cached)."""
    bodies, skipped = [], []
    for a, t in enumerate(traces):
        if t.error is not None or not t.history:
            skipped.append(a)
        else:
            bodies.append((a, request_body(side, a, t.history, 1, ttl_s)))
    return bodies, skipped


def replay(url: str, bodies: list[tuple[int, dict]]) -> list[dict[str, Any]]:
    """The bodies one after another; per request its TTFT (the latency of a 1-token /generate), prompt and
    cached tokens by tier, or its error."""
    import requests

    out = []
    for agent, body in bodies:
        t0 = time.perf_counter()
        try:
            r = requests.post(url + "/generate", json=body, timeout=600)
            r.raise_for_status()
            meta = r.json()["meta_info"]
        except Exception as e:  # recorded; the other replays go on
            out.append({"agent": agent, "error": str(e)})
            continue
        out.append(
            {
                "agent": agent,
                "ttft_s": time.perf_counter() - t0,
                "prompt_tokens": meta["prompt_tokens"],
                "cached_tokens": meta["cached_tokens"],
                "by_tier": dict(meta.get("cached_tokens_by_tier") or {}),
            }
        )
    return out


def replay_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums and TTFT statistics over one phase's replays (failed ones only listed)."""
    ok = [r for r in records if "error" not in r]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    return {
        "replays": len(ok),
        "errors": [f"agent {r['agent']}: {r['error']}" for r in records if "error" in r],
        "prompt_tokens": prompt,
        "prompt_tokens_mean": prompt / len(ok) if ok else math.nan,
        "cached_tokens": cached,
        "cached_tokens_by_tier": {
            k: sum(r["by_tier"].get(k, 0) for r in ok) for k in ("device", "host", "disk")
        },
        "prefill_total": prompt - cached,  # what the replays computed
        "ttft_s": common.summarize([r["ttft_s"] for r in ok]),
    }


def run_restart(args, pool: int, traces: list[AgentTrace], disk_dir: str) -> dict[str, Any]:
    """Replay every agent's next step on a server restarted over `disk_dir`, then on a cold one."""
    import requests

    bodies, skipped = replay_bodies(traces, "sessions+disk", args.session_ttl_s)
    phases: dict[str, Any] = {}
    for phase in ("restart", "cold"):
        d = disk_dir if phase == "restart" else tempfile.mkdtemp(prefix="radixlm-swarm-cold-")
        server = None
        try:
            server, cmd = launch("sessions+disk", args, pool, d, f"sessions+disk_{phase}")
            files = server_info(server.url).get("disk_tier_files")
            warm = request_body("lru", 0, WARM_UP_IDS, 1, 0)
            requests.post(server.url + "/generate", json=warm, timeout=600).raise_for_status()
            records = replay(server.url, bodies)
            info = server_info(server.url)
        finally:
            if server is not None:
                server.stop(timeout_s=STOP_TIMEOUT_S)
            if phase == "cold":
                shutil.rmtree(d, ignore_errors=True)
        phases[phase] = {
            "command": " ".join(cmd[1:]),
            "disk_files_at_start": files,
            **replay_figures(records),
            "disk_loaded_tokens": info.get("disk_loaded_tokens"),
            "disk_rejected_files": info.get("disk_rejected_files"),
            "requests": records,
        }
    r, c = phases["restart"]["ttft_s"], phases["cold"]["ttft_s"]
    return {
        "agents_replayed": len(bodies),
        "agents_skipped": skipped,
        "phases": phases,
        "ttft_p50_restart_vs_cold": common.ratio(r["p50"], c["p50"]),
        "ttft_mean_restart_vs_cold": common.ratio(r["mean"], c["mean"]),
    }


def _at_most(value: float | None, target: float) -> bool | None:
    return None if value is None else value <= target


def target_checks(sides: list[dict[str, Any]], restart: dict[str, Any] | None) -> dict[str, Any]:
    """The issue's three targets, met (True), missed (False) or not measured (None: no lru side, no
    restart phase)."""
    lru = next((r for r in sides if r["side"] == "lru"), None)
    checks: dict[str, Any] = {}
    for r in sides:
        if r["side"] == "lru":
            continue
        rec = common.ratio(r["prefill_recomputed"], lru and lru["prefill_recomputed"])
        # The p99 target is judged on the steps that follow a tool pause. Each agent's first step is the cold
        # prefill of the history the issue gives it at the start ("each with its own 1.5k-token history"):
        # no cache policy can serve it, and their burst takes the same ~50 s on every side, so over all steps
        # the p99 measures that burst, not the cache. It is kept beside the target, not judged.
        later = r.get("later_step_latency_s")
        p99 = common.ratio(later and later["p99"], lru and lru.get("later_step_latency_s", {}).get("p99"))
        checks[r["side"]] = {
            "recomputed_vs_lru": rec,
            f"recomputed_le_{RECOMPUTED_TARGET}x_lru": _at_most(rec, RECOMPUTED_TARGET),
            "p99_vs_lru": p99,
            f"p99_le_{P99_TARGET}x_lru": _at_most(p99, P99_TARGET),
            "p99_all_steps_vs_lru": common.ratio(
                r["step_latency_s"]["p99"], lru and lru["step_latency_s"]["p99"]
            ),
        }
    ratio = restart and restart["ttft_p50_restart_vs_cold"]
    checks["restart"] = {
        "ttft_p50_restart_vs_cold": ratio,
        f"ttft_le_{RESTART_TARGET}x_cold": _at_most(ratio, RESTART_TARGET),
    }
    return checks


def target_rows(checks: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for side, c in checks.items():
        if side == "restart":
            rows.append(
                {
                    "check": f"restart TTFT p50 <= {RESTART_TARGET}x cold",
                    "side": "sessions+disk",
                    "ratio": c["ttft_p50_restart_vs_cold"],
                    "met": c[f"ttft_le_{RESTART_TARGET}x_cold"],
                }
            )
            continue
        rows.append(
            {
                "check": f"recomputed <= {RECOMPUTED_TARGET}x LRU",
                "side": side,
                "ratio": c["recomputed_vs_lru"],
                "met": c[f"recomputed_le_{RECOMPUTED_TARGET}x_lru"],
            }
        )
        rows.append(
            {
                "check": f"step p99 after a tool pause <= {P99_TARGET}x LRU",
                "side": side,
                "ratio": c["p99_vs_lru"],
                "met": c[f"p99_le_{P99_TARGET}x_lru"],
            }
        )
    return rows


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
    p.add_argument(
        "--session-ttl-s",
        type=float,
        default=None,
        help="cache_ttl_s of the sessions sides (default: the longest planned pause + 120 s)",
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-restart",
        dest="restart",
        action="store_false",
        help="skip the restart phase after sessions+disk (a restarted and a cold server replaying each "
        "agent's next step)",
    )
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
    if args.session_ttl_s is None:
        args.session_ttl_s = default_ttl(args)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    bad = [s for s in sides if s not in SIDES]
    if bad:
        p.error(f"unknown side(s) {bad}; known: {', '.join(SIDES)}")
    ws = working_set(args)
    pool = max(256, int(ws * args.pool_fraction))
    scaled = scaled_down(args)
    final = args.history_tokens + args.steps * (args.growth_tokens + args.max_new_tokens)
    note = (
        f"{args.agents} agents, {args.history_tokens}-token histories, {args.steps} steps, pauses median "
        f"{args.pause_median_s * args.pause_scale:.2f} s / p95 {args.pause_p95_s * args.pause_scale:.1f} s"
        + (
            " (SCALED DOWN from the issue's 24 agents, 1.5k tokens, 6 steps, 1 s / 20 s; the restart "
            f"replays {final}-token prompts, not 2k)"
            if scaled
            else ""
        )
        + f"; working set {ws} tokens, KV pool {pool} tokens, session TTL {args.session_ttl_s:.0f} s"
    )
    print(note, flush=True)
    env = common.environment()
    results, restart = [], None
    for side in sides:
        keep = side == "sessions+disk" and args.restart
        res, traces, disk_dir = run_side(side, args, pool, keep_disk=keep)
        results.append(res)
        print(
            f"{side}: prefill {res['prefill_total']} of {res['prompt_tokens']} prompt tokens: "
            f"{res['prefill_new']} new, {res['prefill_recomputed']} recomputed "
            f"{res['recomputed_by_reason']}, "
            f"cached by tier {res['cached_tokens_by_tier']}, step p50 {res['step_latency_s']['p50']:.2f} s "
            f"p99 {res['step_latency_s']['p99']:.2f} s, {res['steps_per_s']:.2f} steps/s, "
            f"errors {len(res['errors'])}, exit {res['stop_exit_code']}",
            flush=True,
        )
        if disk_dir is not None:
            try:
                restart = run_restart(args, pool, traces, disk_dir)
            finally:
                shutil.rmtree(disk_dir, ignore_errors=True)
            for phase, f in restart["phases"].items():
                print(
                    f"{phase}: {f['replays']} replays of {f['prompt_tokens_mean']:.0f} tokens, disk files "
                    f"at start {f['disk_files_at_start']}, cached by tier {f['cached_tokens_by_tier']}, "
                    f"TTFT p50 {f['ttft_s']['p50']:.3f} s mean {f['ttft_s']['mean']:.3f} s, "
                    f"errors {len(f['errors'])}",
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
                "new": r["prefill_new"],
                "total": r["prefill_total"],
                "host hit": r["cached_tokens_by_tier"]["host"],
                "disk hit": r["cached_tokens_by_tier"]["disk"],
                "p50 s": r["step_latency_s"]["p50"],
                "p99 s": r["step_latency_s"]["p99"],
                "p99 vs LRU": common.ratio(r["step_latency_s"]["p99"], lru and lru["step_latency_s"]["p99"]),
                "later p99 s": r["later_step_latency_s"]["p99"],
                "later p99 vs LRU": common.ratio(
                    r["later_step_latency_s"]["p99"], lru and lru["later_step_latency_s"]["p99"]
                ),
                "steps/s": r["steps_per_s"],
            }
        )
    common.print_table(rows, list(rows[0]) if rows else [], "agent swarm")
    restart_rows = []
    if restart is not None:
        for phase, f in restart["phases"].items():
            restart_rows.append(
                {
                    "phase": phase,
                    "replays": f["replays"],
                    "prompt tok": f["prompt_tokens_mean"],
                    "device hit": f["cached_tokens_by_tier"]["device"],
                    "host hit": f["cached_tokens_by_tier"]["host"],
                    "disk hit": f["cached_tokens_by_tier"]["disk"],
                    "TTFT p50 s": f["ttft_s"]["p50"],
                    "TTFT mean s": f["ttft_s"]["mean"],
                    "p50 vs cold": common.ratio(
                        f["ttft_s"]["p50"], restart["phases"]["cold"]["ttft_s"]["p50"]
                    ),
                }
            )
        common.print_table(restart_rows, list(restart_rows[0]), "restart (sessions+disk): next step, 1 token")
    checks = target_checks(results, restart)
    trows = target_rows(checks)
    common.print_table(
        trows, ["check", "side", "ratio", "met"], "targets" + (" (SCALED DOWN run)" if scaled else "")
    )
    config = {**vars(args), "command": common.command_line(), "note": note, "working_set": ws, "pool": pool}
    common.write_results(
        args.name or "agent_swarm",
        config,
        {
            "sides": results,
            "table": rows,
            "restart": restart,
            "restart_table": restart_rows,
            "targets": checks,
        },
        env,
        args.results_dir,
    )


def scaled_down(args) -> bool:
    """Anything smaller than the issue's workload (24 agents, 1.5k-token histories, 6 steps, full pauses)."""
    return (
        args.agents < 24
        or args.history_tokens < 1500
        or args.steps < 6
        or args.growth_tokens < 64
        or args.pause_scale != 1.0
    )


if __name__ == "__main__":
    main()
