"""Run every benchmark (each in its own process, one after another) and print one table of headline figures
against the targets. `make bench` runs `python -m bench.run_all --quick`.

    python -m bench.run_all --quick
    python -m bench.run_all --only mmlu,multi_turn_chat --timeout 3600
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import common


@dataclass(frozen=True)
class Headline:
    """One figure to report: `value(results)` -> (ours, reference); the ratio is compared with `target`."""

    bench: str
    result_file: str
    metric: str
    ours: str
    reference: str
    target: float | None
    batch: str = "32"  # decode_throughput only: the batch size reported (the largest if not measured)
    key: str | None = None  # the per-side figure compared (default: programs_per_s, or accuracy)


def _side(doc: dict, side: str, key: str) -> float | None:
    return doc["results"]["sides"].get(side, {}).get(key)


def _decode(doc: dict, side: str, batch: str = "32") -> float | None:
    """Decode tokens/s at `batch` (or the largest measured) in the first dtype."""
    by = doc["results"]["by_dtype"]
    first = by[next(iter(by))]["batch_sizes"]
    bs = batch if batch in first else max(first, key=int)
    return first[bs].get(side, {}).get("decode_tok_s")


HEADLINES = [
    Headline(
        "decode_throughput", "decode_throughput", "decode tok/s, bs 32 (or largest)", "radixlm", "hf", 1.5
    ),
    # Issue 14's targets against llama.cpp on the same GGUF: single stream >= 0.7x; batch 32 is reported.
    Headline(
        "decode_throughput", "decode_throughput", "decode tok/s, bs 1", "radixlm", "llamacpp", 0.7, batch="1"
    ),
    Headline("decode_throughput", "decode_throughput", "decode tok/s, bs 32", "radixlm", "llamacpp", None),
    Headline("mmlu", "mmlu", "programs/s", "radixlm", "hf", 5.0),
    Headline("mmlu", "mmlu", "accuracy", "radixlm", "hf", None),
    Headline(
        "multi_turn_chat",
        "multi_turn_chat_short",
        "programs/s, short outputs",
        "radixlm",
        "radixlm-noradix",
        3.0,
    ),
    Headline(
        "multi_turn_chat",
        "multi_turn_chat_long",
        "programs/s, long outputs",
        "radixlm",
        "radixlm-noradix",
        3.0,
    ),
    Headline(
        "multi_turn_chat", "multi_turn_chat_short", "programs/s vs HF, short outputs", "radixlm", "hf", None
    ),
    Headline("json_decode", "json_decode", "programs/s, jump-forward on/off", "radixlm", "radixlm-nojf", 1.5),
    Headline("json_decode", "json_decode", "programs/s vs HF", "radixlm", "hf", None),
    Headline("gsm8k", "gsm8k", "programs/s", "radixlm", "hf", None),
    Headline("gsm8k", "gsm8k", "accuracy", "radixlm", "hf", None),
    Headline("tree_of_thought", "tree_of_thought", "programs/s", "radixlm", "hf", None),
    Headline(
        "agent_loop",
        "agent_loop",
        "steps/s, radix on/off",
        "radixlm",
        "radixlm-noradix",
        None,
        key="steps_per_s",
    ),
    Headline("agent_loop", "agent_loop", "steps/s vs HF", "radixlm", "hf", None, key="steps_per_s"),
]
BENCHES = [
    "decode_throughput",
    "mmlu",
    "gsm8k",
    "multi_turn_chat",
    "tree_of_thought",
    "json_decode",
    "json_schema_coverage",
    "agent_loop",
    "serving",
]


def headline_row(h: Headline, doc: dict | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "benchmark": h.result_file,
        "metric": h.metric,
        "ours": None,
        "reference": None,
        "side": f"{h.ours} / {h.reference}",
        "ratio": None,
        "target": h.target,
        "met": None,
    }
    if doc is None:
        return row
    try:
        if h.bench == "decode_throughput":
            ours, ref = _decode(doc, h.ours, h.batch), _decode(doc, h.reference, h.batch)
        else:
            key = h.key or ("accuracy" if h.metric == "accuracy" else "programs_per_s")
            ours, ref = _side(doc, h.ours, key), _side(doc, h.reference, key)
    except (KeyError, StopIteration, ValueError):
        return row
    row.update(ours=ours, reference=ref)
    if h.metric == "accuracy":
        row["met"] = None if ours is None or ref is None else ours == ref
        return row
    row["ratio"] = common.ratio(ours, ref)
    if h.target is not None and row["ratio"] is not None:
        row["met"] = row["ratio"] >= h.target
    return row


def run_bench(name: str, quick: bool, results_dir: Path, timeout: float, extra: list[str]) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        f"bench.{name}",
        "--results-dir",
        str(results_dir),
        *(["--quick"] if quick else []),
    ]
    if name == "serving":
        cmd += ["--launch-server", "--no-progress"]
    cmd += extra
    print(f"\n[run_all] {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(cmd, cwd=common.REPO_ROOT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    return {"bench": name, "command": " ".join(cmd), "returncode": rc, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> dict:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(BENCHES), help="comma-separated subset, in this order")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per benchmark")
    p.add_argument("--summary-only", action="store_true", help="only summarize existing result files")
    args = p.parse_args(argv)
    common.setup_env()
    results_dir = Path(args.results_dir)
    env = common.environment()
    env["load_before"] = common.load_average()
    runs = []
    if not args.summary_only:
        for name in common.csv_list(args.only):
            if name not in BENCHES:
                p.error(f"unknown benchmark {name!r} (known: {', '.join(BENCHES)})")
            runs.append(run_bench(name, args.quick, results_dir, args.timeout, []))
    rows = [headline_row(h, _load(results_dir / f"{h.result_file}.json")) for h in HEADLINES]
    serving = _load(results_dir / "serving.json")
    if serving:
        for r in serving["results"]["runs"]:
            rows.append(
                {
                    "benchmark": "serving",
                    "metric": f"out tok/s ({r['label']})",
                    "ours": r["output_token_throughput"],
                    "side": "llamacpp" if r["label"] == "llamacpp" else "radixlm",
                }
            )
    print()
    common.print_table(
        rows,
        ["benchmark", "metric", "side", "ours", "reference", "ratio", "target", "met"],
        title="== radixlm benchmarks: headline figures ==",
    )
    for r in runs:
        if r["returncode"] != 0:
            print(f"FAILED: {r['bench']} (exit {r['returncode']}): {r['command']}")
    plotted = [r for r in rows if r.get("ratio") is not None]
    if plotted:
        common.bar_chart(
            common.plot_path(args.name or "run_all", results_dir),
            [f"{r['benchmark']}\n{r['side']}" for r in plotted],
            {"ratio": [r["ratio"] for r in plotted], "target": [r["target"] for r in plotted]},
            "speedup",
            "radixlm speedups vs targets",
        )
    config = {"command": common.command_line(), "quick": args.quick, "only": args.only}
    common.write_results(args.name or "run_all", config, {"runs": runs, "headlines": rows}, env, results_dir)
    failed = [r for r in runs if r["returncode"] != 0]
    if failed:
        sys.exit(1)
    return {"runs": runs, "headlines": rows}


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


if __name__ == "__main__":
    main()
