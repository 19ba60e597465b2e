"""JSONSchemaBench coverage: which real-world schemas compile, how fast, and how often greedy output
validates.

For each grammar backend of `--backends` (constrained.backends: outlines, llguidance, xgrammar; one not
installed is reported and skipped) and each subset of bench/data/jsonschemabench (Github_trivial,
Github_easy, Glaiveai2K; a byte-identical copy of the public JSONSchemaBench files) the same seeded sample of
schemas goes through the server's own path:

1. compile: the HTTP-side check (`GrammarValidator` of runtime.managers.tokenizer: `validate_spec` in the
   capped worker pool, the server's limits) and then the scheduler's compile
   (`constrained.GrammarCompiler` over a `constrained.compile_pool.CompilePool`: worker processes with the
   server's --grammar-workers, --grammar-memory-mb and --grammar-timeout-s, or `--compile-*`), each schema
   compiled cold, submitted in chunks of 4 per worker. Compile time is the worker's (queue wait excluded,
   as the server counts it); a schema past a limit counts as `timeout` or `memory`, never as compiled. Peak
   RSS of this process and all its children is sampled during each stage. When its chunk has compiled, each
   compiled grammar is walked at random (`bench.grammar_walk`, `--walk-steps` tokens at most): every step's
   `fill_vocab_mask` is timed (mask p50/p99 in µs per token; `mask_cpu_us`: the same in this thread's CPU
   time, which a loaded machine's waits for a core leave out) and a finished walk is checked with
   `jsonschema` (`walk valid %`).
2. generate: every schema that compiled is sent through `runtime.Engine` (default model, greedy,
   `--max-new-tokens`), all at once. An output that ends by the grammar is `valid` or `invalid` under the
   `jsonschema` package (the schema's own draft; `format` is an annotation, not checked); an output cut by
   max_new_tokens is `truncated`, neither valid nor invalid. `error`: the request failed; `unchecked`:
   `jsonschema` cannot use the schema itself.

`--compile-only` stops after stage 1 (no model is loaded): the way to measure compile coverage over a large
sample; the summary lists the rejection reasons by construct (`rejection_reasons`).

`--mask-overhead` measures instead what constrained decoding adds to a decode step, in microseconds per
decoded token (see `bench.json_mask_overhead`).

    python -m bench.json_schema_coverage --quick
    python -m bench.json_schema_coverage --per-subset 16 --max-new-tokens 64
    python -m bench.json_schema_coverage --compile-only --per-subset 150
    python -m bench.json_schema_coverage --backends outlines,llguidance,xgrammar --compile-only
    python -m bench.json_schema_coverage --mask-overhead --batch-size 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench.grammar_walk import TARGET_COMPILED_SHARE, TARGET_MASK_P99_US, auto_choice
from bench.harness import common
from bench.harness.datasets import JSONSCHEMABENCH_SUBSETS as SUBSETS
from bench.harness.datasets import chat_prompt, load_subset, sample_rows, schema_text
from bench.harness.rss import PeakRss

OUTPUT_KINDS = ("valid", "invalid", "truncated", "error", "unchecked")
STOP = {"type": "stop", "matched": None}
WALK_CHUNK_PER_WORKER = 4  # schemas compiled per chunk (per compile worker) before the chunk's walks


# ------------------------------------------------------------------------------------------ pure helpers
def classify_output(schema: Any, text: str, finish_reason: dict[str, Any] | None) -> tuple[str, str | None]:
    """(kind, detail): kind in OUTPUT_KINDS; detail names the failing keyword, or why nothing was checked.

    An output cut by max_new_tokens is `truncated` whatever its text: it says nothing about the grammar.
    """
    import jsonschema

    kind = (finish_reason or {}).get("type")
    if kind == "length":
        return "truncated", None
    if kind != "stop":
        return "error", str((finish_reason or {}).get("message") or kind)
    try:
        instance = json.loads(text)
    except json.JSONDecodeError:
        return "invalid", "not JSON"
    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
        if error is not None and error.validator == "multipleOf":
            # float division fails exact decimal multiples (0.07 / 0.01 = 7.000000000000001): check those
            # numbers as decimals, as JSON writes them
            exact = json.loads(json.dumps(schema), parse_float=Decimal)
            decimal_instance = json.loads(text, parse_float=Decimal)
            validator = jsonschema.validators.validator_for(exact)(exact)
            error = jsonschema.exceptions.best_match(validator.iter_errors(decimal_instance))
    except Exception as err:  # unresolvable $ref, a pattern Python's re rejects, a malformed schema
        return "unchecked", f"{type(err).__name__}: {str(err)[:120]}"
    if error is None:
        return "valid", None
    return "invalid", str(error.validator)


def shares(counts: dict[str, int], total: int) -> dict[str, float | None]:
    """`{kind}_share` for every OUTPUT_KINDS entry (None when there is nothing to divide)."""
    return {f"{k}_share": (counts.get(k, 0) / total if total else None) for k in OUTPUT_KINDS}


def reason_key(reason: str) -> str:
    """A rejection reason with its schema-specific details (quoted names, numbers, listed values) blanked,
    so that rejections group by construct."""
    key = re.sub(r"'[^']*'|\"[^\"]*\"", "'_'", reason.split("\n")[0])
    key = re.sub(r"\[[^\]]*\]|\{[^}]*\}", "[_]", key)
    return re.sub(r"\b\d+(\.\d+)?\b", "N", key)[:120]


def summarize_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures of one subset (or all): compile outcome shares and times, output kind shares."""
    n = len(records)
    compiled = [r for r in records if r["compile"] == "ok"]
    compile_ms = [1000 * r["compile_s"] for r in compiled]
    validate_ms = [1000 * r["validate_s"] for r in records if r.get("validate_s") is not None]
    outputs = [r for r in records if r.get("output")]
    counts = Counter(r["output"] for r in outputs)
    invalid_keywords = Counter(r["output_detail"] for r in outputs if r["output"] == "invalid")
    mask_us = [t for r in records for t in r.get("mask_us") or ()]
    mask_cpu_us = [t for r in records for t in r.get("mask_cpu_us") or ()]
    walks = Counter(r["walk"] for r in records if r.get("walk"))
    judged = walks.get("valid", 0) + walks.get("invalid", 0)
    return {
        "schemas": n,
        "compiled": len(compiled),
        "compiled_share": len(compiled) / n if n else None,
        "compile_outcomes": dict(Counter(r["compile"] for r in records)),
        "rejection_reasons": dict(
            Counter(
                reason_key(r.get("reason") or r["compile"]) for r in records if r["compile"] != "ok"
            ).most_common()
        ),
        "compile_ms": {
            "p50": common.percentile(compile_ms, 50),
            "p95": common.percentile(compile_ms, 95),
            "mean": _mean(compile_ms),
            "max": max(compile_ms, default=None),
        },
        "validate_ms": {"p50": common.percentile(validate_ms, 50), "p95": common.percentile(validate_ms, 95)},
        "outputs": len(outputs),
        "output_counts": {k: counts.get(k, 0) for k in OUTPUT_KINDS},
        **shares(counts, len(outputs)),
        "valid_of_all_schemas": counts.get("valid", 0) / n if n else None,
        "invalid_keywords": dict(invalid_keywords.most_common()),
        "completion_tokens_mean": _mean([r["completion_tokens"] for r in outputs]),
        "mask_us": {
            "p50": common.percentile(mask_us, 50),
            "p99": common.percentile(mask_us, 99),
            "max": max(mask_us, default=None),
            "tokens": len(mask_us),
        },
        # the same fills in this thread's CPU time: on a loaded machine the wall time above also counts
        # the fills that waited for a core
        "mask_cpu_us": {
            "p50": common.percentile(mask_cpu_us, 50),
            "p99": common.percentile(mask_cpu_us, 99),
            "max": max(mask_cpu_us, default=None),
        },
        "walks": dict(walks),
        "walk_valid_share": walks.get("valid", 0) / judged if judged else None,
        "walk_invalid_keywords": dict(
            Counter(r.get("walk_detail") for r in records if r.get("walk") == "invalid").most_common()
        ),
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def table_row(name: str, s: dict[str, Any]) -> dict[str, Any]:
    pct = lambda v: None if v is None else 100 * v  # noqa: E731
    return {
        "subset": name,
        "schemas": s["schemas"],
        "compiles %": pct(s["compiled_share"]),
        "timeouts": s["compile_outcomes"].get("timeout", 0),
        "over memory": s["compile_outcomes"].get("memory", 0),
        "compile p50 ms": s["compile_ms"]["p50"],
        "compile p95 ms": s["compile_ms"]["p95"],
        "outputs": s["outputs"],
        "valid %": pct(s["valid_share"]),
        "invalid %": pct(s["invalid_share"]),
        "truncated %": pct(s["truncated_share"]),
        "errors": s["output_counts"]["error"] + s["output_counts"]["unchecked"],
        "mask p50 us": s["mask_us"]["p50"],
        "mask p99 us": s["mask_us"]["p99"],
        "mask p99 cpu us": s["mask_cpu_us"]["p99"],
        "walk valid %": pct(s["walk_valid_share"]),
    }


# ------------------------------------------------------------------------------------------ compile stage
def compile_outcome(reason: str) -> str:
    """``timeout`` / ``memory`` for a compile past a server limit, else ``error`` (any other 400)."""
    if "--grammar-timeout-s" in reason:
        return "timeout"
    if "--grammar-memory-mb" in reason:
        return "memory"
    return "error"


def server_args_for(backend: str, **extra):
    """ServerArgs (the server's defaults) with --grammar-backend ``backend``."""
    from runtime.server_args import ServerArgs

    return ServerArgs(grammar_backend=backend, **extra)


def validate_all(specs: list[str], backend: str = "outlines") -> list[tuple[str | None, float | None]]:
    """(verdict, seconds) per spec from the server's HTTP-side checker: None = accepted, else the 400
    reason.
    """
    from runtime.managers.tokenizer.grammar_validator import GrammarValidator

    server = server_args_for(backend)

    async def run() -> list[tuple[str | None, float]]:
        validator = GrammarValidator(server)  # the server's limits
        out = []
        try:
            # the first check starts the checker's process: a one-off cost, not a check's
            await validator.validate("json_schema", '{"type": "null"}')
            for spec in specs:
                start = time.perf_counter()
                verdict = await validator.validate("json_schema", spec)
                out.append((verdict, time.perf_counter() - start))
        finally:
            validator.close()
        return out

    return asyncio.run(run())


def compile_stage(
    records: list[dict[str, Any]], model_dir: str, args: argparse.Namespace, backend: str = "outlines"
) -> dict[str, Any]:
    """Fill `compile` (ok | rejected | error | timeout | memory), `compile_s`, `validate_s`, `reason`, and
    for compiled schemas the random walk's `walk`, `walk_detail` and `mask_us` (``bench.grammar_walk``).

    The server's own path: the HTTP-side check, then a ``GrammarCompiler`` over a ``CompilePool`` with the
    server's limits (or the ones given). Schemas are submitted in chunks (WALK_CHUNK_PER_WORKER per worker)
    and a chunk's walks start when all its compiles have finished; `compile_s` is the worker's compile
    time, queue wait excluded, as the server counts it against --grammar-timeout-s.
    """
    from bench.grammar_walk import classify_walk, walk
    from constrained import GrammarCompiler
    from runtime.models.model_loader import load_tokenizer

    verdicts = validate_all([r["spec"] for r in records], backend)
    todo = []
    for rec, (verdict, seconds) in zip(records, verdicts):
        rec["validate_s"] = seconds
        if verdict is not None:
            rec.update(compile="rejected", compile_s=None, reason=verdict)
        else:
            todo.append(rec)
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    limits = dict(
        workers=args.compile_workers,
        memory_mb=args.compile_memory_mb,
        timeout_s=args.compile_timeout,
        queue_size=max(len(todo), 1),
    )
    compiler = GrammarCompiler(load_tokenizer(model_dir), vocab_size, pool_limits=limits, backend=backend)
    chunk = max(1, WALK_CHUNK_PER_WORKER * args.compile_workers)
    try:
        for start in range(0, len(todo), chunk):
            part = todo[start : start + chunk]
            futures = [compiler.compile_async("json_schema", rec["spec"]) for rec in part]
            # every compile of the chunk finishes before its walks start, so the masks are not timed against
            # the bench's own compile workers (on 2 cores a walk beside them waits for a core: wall-time
            # masks of 1-3 ms whose CPU time was under 0.6 ms); a chunk bounds how many grammars are held
            outcomes: list[Any] = []
            for future in futures:
                try:
                    outcomes.append(future.result())
                except ValueError as err:  # GrammarError: the server answers 400 with this reason
                    outcomes.append(err)
            del futures
            for offset, rec in enumerate(part):
                grammar, outcomes[offset] = outcomes[offset], None
                if isinstance(grammar, ValueError):
                    rec.update(
                        compile=compile_outcome(str(grammar)), compile_s=None, reason=str(grammar)[:300]
                    )
                else:
                    rec.update(compile="ok", compile_s=grammar.compile_seconds, reason=None)
                    rec["mask_cpu_us"] = []
                    text, rec["mask_us"] = walk(
                        grammar,
                        compiler.vocab,
                        vocab_size,
                        args.seed + start + offset,
                        args.walk_steps,
                        rec["mask_cpu_us"],
                    )
                    rec["walk"], rec["walk_detail"] = classify_walk(json.loads(rec["spec"]), text)
                    del grammar
                    compiler.clear()  # the walk filled its masks: free them before the next one
                print(
                    f"  compile {rec['subset']}/{rec['id']}: {rec['compile']} {rec['compile_s'] or 0:.2f}s",
                    flush=True,
                )
        stats = compiler.stats()
    finally:
        compiler.shutdown()
    return stats


# ------------------------------------------------------------------------------------------ generate stage
def generate_stage(
    records: list[dict[str, Any]], args: argparse.Namespace, backend: str = "outlines"
) -> dict[str, Any]:
    """Greedy outputs for the compiled schemas, all in flight at once; fills `output`, `output_detail`, ..."""
    from runtime import Engine

    todo = [r for r in records if r["compile"] == "ok"]
    if not todo:
        return {}
    engine = Engine(
        model="default", log_level="warning", num_threads=args.threads or None, grammar_backend=backend
    )
    try:
        params = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}
        prompts = [chat_prompt(engine.tokenizer, r["spec"]) for r in todo]

        async def run() -> list[Any]:
            calls = [
                engine.async_generate(p, {**params, "json_schema": r["spec"]}) for p, r in zip(prompts, todo)
            ]
            return await asyncio.gather(*calls, return_exceptions=True)

        start = time.perf_counter()
        results = asyncio.run(run())
        wall = time.perf_counter() - start
        info = engine.server_info()
    finally:
        engine.shutdown()
    for rec, res in zip(todo, results):
        if isinstance(res, Exception):
            rec.update(output="error", output_detail=str(res)[:300], completion_tokens=0, text=None)
            continue
        meta = res["meta_info"]
        kind, detail = classify_output(json.loads(rec["spec"]), res["text"], meta.get("finish_reason"))
        rec.update(
            output=kind,
            output_detail=detail,
            completion_tokens=meta.get("completion_tokens", 0),
            text=res["text"][:400],
        )
    keys = ("generated_tokens", "decode_steps", "extend_steps", "jump_forward_tokens", "grammar")
    return {"wall_s": wall, "requests": len(todo), "server": {k: info.get(k) for k in keys}}


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--per-subset",
        type=int,
        default=10,
        help="schemas sampled from each subset (10: 2.5 min on 2 loaded cores, plus up to 2 min if a schema "
        "hits the compile timeout)",
    )
    p.add_argument("--subsets", default=",".join(SUBSETS), help="comma-separated subset names")
    p.add_argument(
        "--backends",
        default="auto,outlines,llguidance,xgrammar",
        help="comma-separated grammar backends (constrained.backends) measured on the same sample; `auto` is "
        "the server's default chain (each schema on the first backend that can enforce it)",
    )
    p.add_argument(
        "--walk-steps", type=int, default=64, help="tokens at most per compiled schema's timed random walk"
    )
    p.add_argument(
        "--compile-only", action="store_true", help="stop after the compile stage (no model, no outputs)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="greedy output budget per schema")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument(
        "--compile-timeout",
        type=float,
        default=0.0,
        help="seconds per schema compile, queue wait excluded (0: the server's --grammar-timeout-s default)",
    )
    p.add_argument("--compile-workers", type=int, default=0, help="parallel compiles (0: the server's)")
    p.add_argument(
        "--compile-memory-mb",
        type=int,
        default=0,
        help="address space a compile may add to its worker (0: the server's --grammar-memory-mb default)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the model (0: all cores). 1 by default: on a loaded 2-core machine "
        "2 threads measured 10x slower (OpenMP stalls on descheduled threads)",
    )
    p.add_argument(
        "--mask-overhead", action="store_true", help="measure the per-token grammar mask cost instead"
    )
    p.add_argument("--batch-size", type=int, default=8, help="--mask-overhead: requests decoding together")
    p.add_argument(
        "--repeats", type=int, default=3, help="--mask-overhead: replays per variant (min reported)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.per_subset, args.max_new_tokens, args.batch_size = 3, 48, 4
    from runtime.server_args import ServerArgs

    server = ServerArgs()  # the server's defaults
    args.compile_workers = args.compile_workers or server.grammar_workers
    args.compile_timeout = args.compile_timeout or server.grammar_timeout_s
    args.compile_memory_mb = args.compile_memory_mb or server.grammar_memory_mb
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    common.setup_env()
    env = common.environment()
    env["load_before"] = common.load_average()
    if args.mask_overhead:
        from bench.json_mask_overhead import run_mask_overhead

        return run_mask_overhead(args, env)
    from constrained import DEFAULT_WHITESPACE
    from constrained.backends import get_backend
    from constrained.errors import GrammarError
    from runtime.models.model_loader import resolve_model_path

    subsets = common.csv_list(args.subsets)
    sample = [
        {"subset": s, "id": row["id"], "spec": schema_text(row["schema"])}
        for s in subsets
        for row in sample_rows(load_subset(s), args.per_subset, args.seed)
    ]
    start = time.perf_counter()
    per_backend: dict[str, Any] = {}
    unavailable: dict[str, str] = {}
    records: list[dict[str, Any]] = []
    for backend in common.csv_list(args.backends):
        try:
            if backend != "auto":
                get_backend(backend)
        except GrammarError as err:
            unavailable[backend] = str(err)
            print(f"[json_schema_coverage] skipping {backend}: {err}", flush=True)
            continue
        recs = [dict(r, backend=backend) for r in sample]
        records += recs
        t0 = time.perf_counter()
        print(f"[json_schema_coverage] {backend}: compiling {len(recs)} schemas ...", flush=True)
        with PeakRss() as compile_rss:
            compile_stats = compile_stage(recs, resolve_model_path("default"), args, backend)
        compile_wall = time.perf_counter() - t0
        compiled = sum(r["compile"] == "ok" for r in recs)
        print(f"[json_schema_coverage] {backend}: generating for {compiled} schemas ...", flush=True)
        with PeakRss() as generate_rss:
            generation = {} if args.compile_only else generate_stage(recs, args, backend)
        summaries = {s: summarize_records([r for r in recs if r["subset"] == s]) for s in subsets}
        summaries["all"] = summarize_records(recs)
        per_backend[backend] = {
            "subsets": summaries,
            "generation": generation,
            "compile_wall_s": compile_wall,
            "compile_stats": compile_stats,
            "peak_rss_mb": {"compile": compile_rss.peak_mb, "generate": generate_rss.peak_mb},
        }
    print()
    rows = [
        {"backend": b, **table_row(name, s)}
        for b, res in per_backend.items()
        for name, s in res["subsets"].items()
    ]
    common.print_table(rows, title="== json_schema_coverage ==")
    for b, res in per_backend.items():
        for reason, count in res["subsets"]["all"]["rejection_reasons"].items():
            print(f"  {b}: {count} x {reason}")
        rss = res["peak_rss_mb"]
        print(
            f"  {b}: peak RSS (this process and its children): compile {rss['compile']:.0f} MB, "
            f"generate {rss['generate']:.0f} MB"
        )
    auto = auto_choice({b: res["subsets"]["all"] for b, res in per_backend.items() if b != "auto"})
    print(f"auto by these figures: {auto['choice']} (targets met: {auto['targets_met']})")
    results = {
        "backends": per_backend,
        "unavailable": unavailable,
        "auto": auto,
        "table": rows,
        "total_wall_s": time.perf_counter() - start,
        "schemas": [
            {k: v for k, v in r.items() if k not in ("spec", "mask_us", "mask_cpu_us")} for r in records
        ],
    }
    config = {
        "command": common.command_line(),
        "backends": list(per_backend),
        "subsets": subsets,
        "per_subset": args.per_subset,
        "seed": args.seed,
        "max_new_tokens": None if args.compile_only else args.max_new_tokens,
        "compile_only": args.compile_only,
        "walk_steps": args.walk_steps,
        "model": "default",
        "greedy": True,
        "whitespace_pattern": DEFAULT_WHITESPACE,
        "validation_timeout_s": args.compile_timeout,  # the server checks specs under --grammar-timeout-s
        "compile_timeout_s": args.compile_timeout,
        "compile_workers": args.compile_workers,
        "compile_memory_mb": args.compile_memory_mb,
        "threads": args.threads,
        "format_checked": False,
        "targets": {"compiled_share": TARGET_COMPILED_SHARE, "mask_p99_us": TARGET_MASK_P99_US},
    }
    name = args.name or ("json_schema_compile_coverage" if args.compile_only else "json_schema_coverage")
    groups = [*subsets, "all"]
    series = {}
    for b, res in per_backend.items():
        series[f"{b} compiles"] = [res["subsets"][g]["compiled_share"] for g in groups]
        series[f"{b} walks valid"] = [res["subsets"][g]["walk_valid_share"] for g in groups]
        if not args.compile_only:
            series[f"{b} valid"] = [res["subsets"][g]["valid_share"] for g in groups]
    common.bar_chart(
        common.plot_path(name, args.results_dir),
        groups,
        series,
        "share",
        f"JSONSchemaBench, {args.per_subset}/subset"
        + ("" if args.compile_only else f", greedy, {args.max_new_tokens} new tokens"),
    )
    common.write_results(name, config, results, env, args.results_dir)
    return results


if __name__ == "__main__":
    main()
