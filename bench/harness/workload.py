"""Run one DSL workload on several sides in one invocation and report them side by side.

For each side: open it, run a few warm-up programs, flush the prefix cache, then run every item concurrently
on `num_threads` threads, timing each program; then read accuracy (when the workload scores), programs/s,
generated tokens/s, latency percentiles and the radix cache hit rate over the measured run (change of the
server's `cached_tokens / prompt_tokens` counters), and close the side before the next one opens.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from bench.harness import common
from bench.harness.sides import HF, Metered, OpenSide, add_side_args, open_side, side_names


@dataclass
class Workload:
    name: str
    program: Any  # a lang Program
    items: list[dict[str, Any]]  # keyword arguments of one program run each
    labels: list[Any] = field(default_factory=list)  # per item, what `score` compares against
    # (label, state) -> 1.0 correct / 0.0 wrong; None: the workload has no accuracy.
    score: Callable[[Any, Any], float] | None = None
    # state -> the program's answer, compared between sides ("agreement").
    prediction: Callable[[Any], Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    warmup_items: list[dict[str, Any]] = field(default_factory=list)
    run_kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments of every run


def add_workload_args(p: argparse.ArgumentParser, default_sides: str, num_threads: int) -> None:
    add_side_args(p, default_sides)
    p.add_argument("--num-threads", type=int, default=num_threads, help="programs in flight at once")
    p.add_argument("--seed", type=int, default=0, help="item sampling seed")
    p.add_argument("--repeats", type=int, default=1, help="measured runs per side; the fastest is reported")


def run_programs(
    program: Any,
    items: list[dict[str, Any]],
    backend: Any,
    num_threads: int,
    run_kwargs: dict[str, Any] | None = None,
    progress: str | None = None,
) -> tuple[list[Any], list[float], float]:
    """(states or exceptions in item order, per-program latency seconds, wall seconds)."""
    from tqdm.auto import tqdm

    latencies = [float("nan")] * len(items)
    run_kwargs = run_kwargs or {}

    def one(i: int) -> Any:
        t0 = time.perf_counter()
        try:
            return program.run(backend=backend, **run_kwargs, **items[i])
        except Exception as e:  # reported as an error count, the run goes on
            return e
        finally:
            latencies[i] = time.perf_counter() - t0

    t0 = time.perf_counter()
    with (
        ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool,
        tqdm(total=len(items), desc=progress, disable=progress is None, leave=False) as bar,
    ):
        futures = [pool.submit(one, i) for i in range(len(items))]
        states = []
        for fut in futures:
            states.append(fut.result())
            bar.update(1)
    return states, latencies, time.perf_counter() - t0


def measure_side(side: OpenSide, wl: Workload, num_threads: int) -> tuple[dict[str, Any], list[Any]]:
    """Warm up, flush, run every item; return (figures, states)."""
    backend = Metered(side.backend)
    if wl.warmup_items:
        run_programs(wl.program, wl.warmup_items, backend, num_threads, wl.run_kwargs)
    side.flush()
    backend.reset()
    before, load_before = side.counters(), common.load_average()
    states, lat, wall = run_programs(
        wl.program, wl.items, backend, num_threads, wl.run_kwargs, progress=f"{wl.name}[{side.name}]"
    )
    after = side.counters()
    errors = [s for s in states if isinstance(s, Exception)]
    n = len(wl.items)
    fig: dict[str, Any] = {
        "side": side.name,
        "programs": n,
        "errors": len(errors),
        "first_error": repr(errors[0])[:300] if errors else None,
        "wall_s": wall,
        "programs_per_s": n / wall if wall > 0 else None,
        "gen_calls": backend.calls["gen"],
        "select_calls": backend.calls["select"],
        "prompt_tokens": backend.tokens["prompt"],
        "completion_tokens": backend.tokens["completion"],
        "gen_tokens_per_s": backend.tokens["completion"] / wall if wall > 0 else None,
        "latency_s": common.summarize([x for x in lat if x == x]),
        "load_before": load_before,
        "open_s": side.open_seconds,
        "side_config": side.config,
    }
    if wl.score is not None:
        scores = [wl.score(label, s) for label, s in zip(wl.labels, states) if not isinstance(s, Exception)]
        fig["accuracy"] = sum(scores) / n if n else None  # an errored program counts as wrong
        fig["correct"] = sum(scores)
    if side.is_hf:
        fig["cache_hit_rate"] = 0.0
        fig["hf_batches"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    else:
        delta = {k: after[k] - before[k] for k in after}
        fig["server_counters"] = delta
        fig["cache_hit_rate"] = (
            delta["cached_tokens"] / delta["prompt_tokens"] if delta["prompt_tokens"] else 0.0
        )
    return fig, states


def compare(
    wl: Workload,
    args: argparse.Namespace,
    baseline: str | None = None,
    extra: Callable[[dict[str, dict[str, Any]], dict[str, list[Any]]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Run `wl` on every side of `args.sides`; print the table; write results JSON and plot; return results.

    `baseline`: the side speedups are relative to (default: `hf` when present, else the last side).
    """
    common.setup_env()
    env = common.environment()
    env["load_before"] = common.load_average()
    names = side_names(args.sides)
    per_side: dict[str, dict[str, Any]] = {}
    states: dict[str, list[Any]] = {}
    for name in names:
        print(f"[{wl.name}] opening {name} ...", flush=True)
        side = open_side(name, args)
        try:
            # Best of --repeats (all recorded): on a shared machine the fastest run is the least disturbed.
            runs = [measure_side(side, wl, args.num_threads) for _ in range(max(1, args.repeats))]
        finally:
            side.close()
        best = max(runs, key=lambda r: r[0]["programs_per_s"] or 0.0)
        per_side[name], states[name] = best
        per_side[name]["programs_per_s_samples"] = [r[0]["programs_per_s"] for r in runs]
    baseline = baseline or (HF if HF in per_side else names[-1])
    base_rate = per_side[baseline]["programs_per_s"]
    for fig in per_side.values():
        fig["speedup_vs_" + baseline] = common.ratio(fig["programs_per_s"], base_rate)
    results: dict[str, Any] = {"sides": per_side, "baseline": baseline}
    if wl.prediction is not None and len(names) > 1:
        results["agreement"] = agreement(wl, names, states)
    if extra is not None:
        results.update(extra(per_side, states))
    name = args.name or wl.name
    config = {
        "command": common.command_line(),
        "workload": wl.name,
        "items": len(wl.items),
        "num_threads": args.num_threads,
        "sides": names,
        "repeats": args.repeats,
        **wl.config,
    }
    print_summary(wl.name, per_side, baseline, results.get("agreement"))
    plot(name, per_side, baseline, args.results_dir)
    common.write_results(name, config, results, env, args.results_dir)
    return results


def agreement(wl: Workload, names: list[str], states: dict[str, list[Any]]) -> dict[str, Any]:
    """Share of items where each side's answer equals the first side's (errors never agree)."""
    ref = names[0]
    out: dict[str, Any] = {"reference": ref}
    for other in names[1:]:
        same = 0
        for a, b in zip(states[ref], states[other]):
            if (
                not isinstance(a, Exception)
                and not isinstance(b, Exception)
                and wl.prediction(a) == wl.prediction(b)
            ):
                same += 1
        out[other] = same / len(wl.items) if wl.items else None
    return out


def summary_rows(per_side: dict[str, dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    rows = []
    for name, f in per_side.items():
        rows.append(
            {
                "side": name,
                "accuracy": f.get("accuracy"),
                "programs/s": f["programs_per_s"],
                f"x {baseline}": f.get("speedup_vs_" + baseline),
                "gen tok/s": f["gen_tokens_per_s"],
                "lat p50 s": f["latency_s"]["p50"],
                "lat p99 s": f["latency_s"]["p99"],
                "cache hit": f["cache_hit_rate"],
                "errors": f["errors"],
                "load": f["load_before"]["load_1m"],
            }
        )
    return rows


def print_summary(
    title: str, per_side: dict[str, dict[str, Any]], baseline: str, agree: dict[str, Any] | None
) -> None:
    print()
    common.print_table(summary_rows(per_side, baseline), title=f"== {title} ==")
    if agree:
        print(
            "answer agreement with "
            + agree["reference"]
            + ": "
            + ", ".join(f"{k} {v:.3f}" for k, v in agree.items() if k != "reference")
        )


def plot(name: str, per_side: dict[str, dict[str, Any]], baseline: str, results_dir: str) -> None:
    sides = list(per_side)
    series = {"programs/s": [per_side[s]["programs_per_s"] for s in sides]}
    common.bar_chart(
        common.plot_path(name, results_dir),
        sides,
        series,
        "programs / s",
        f"{name}: throughput by side (baseline {baseline})",
    )
