"""Tool-set grammars under `tool_choice: "required"`: build, compile and first-mask time, per backend.

Tool sets of 5, 6, 20 and 40 tools of real-world shapes: the six ordinary tools of issue 23
(bench/data/tool_sets/issue23_tools.json: an enum, date-time/email formats and an array, a `^SELECT .{1,60}$`
pattern, an array of passenger objects, an anyOf, a nested object with a nullable number), then Glaive
function schemas (bench/data/jsonschemabench/Glaiveai2K.jsonl) in file order. For each set (hermes format,
parallel calls allowed):

* build: `tool_calls.grammar.forced_lark` from the parsed tools, memo cleared (cold) and memo hit;
* llguidance: `LLMatcher.validate_grammar` (the HTTP-side check) and `LLMatcher(...)` construction over the
  default model's tokenizer (the compile), cold then the median of `--repeats` (wall and this process's CPU
  time: on a shared, loaded machine the wall time includes waiting for a core); the first mask; the mask
  time per token over a 64-token random walk (p50 / p99 -- of 64 samples, nearly the maximum);
* server path (`server_path`): what the scheduler pays, over the same tokenizer the server builds
  (`constrained.vocab` + the llguidance backend): per seed (`--server-seeds`) the sandbox worker's build and
  the scheduler's `load` (template matcher and start mask) of a fresh grammar, then the first request's
  walk (`bench.grammar_walk.walk`: every state a first visit of llguidance's lazily built lexer) and a
  later request's walk of the same grammar (states built); each `fill_vocab_mask` timed in wall and in this
  thread's CPU time (p50 / p99 over all seeds' masks): on a loaded machine the wall time also counts waits
  for a core;
* outlines (comparison): `schema.forced_regex`, then the server's compile (`constrained.GrammarCompiler` in a
  `CompilePool` worker: the server's 2048 MB memory cap and `--outlines-timeout` seconds).

    python -m bench.tool_grammar                      # all sizes, outlines capped at 60 s each
    python -m bench.tool_grammar --no-outlines --repeats 20
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"
ISSUE_TOOLS = DATA / "tool_sets/issue23_tools.json"
GLAIVE = DATA / "jsonschemabench/Glaiveai2K.jsonl"
# Glaive schemas the request check refuses (tests/unit/test_tool_call_schemas.py says why): not in sets.
_REFUSED = {"calculate_area_2f92f3ea", "calculate_area_08e029cf", "calculate_area_27950976"}


def tool_set(n: int) -> list[dict[str, Any]]:
    """`n` OpenAI tools: the issue's six first (the first `n` of them when n < 6), then Glaive schemas."""
    tools = json.loads(ISSUE_TOOLS.read_text())[:n]
    for line in GLAIVE.read_text().splitlines():
        if len(tools) >= n:
            break
        row = json.loads(line)
        if row["id"] not in _REFUSED:
            tools.append(
                {"type": "function", "function": {"name": row["id"][:64], "parameters": row["schema"]}}
            )
    return tools


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def measure_llguidance(lark: str, tok: Any, repeats: int, rng: random.Random) -> dict[str, Any]:
    import numpy as np
    from llguidance import LLMatcher
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    t = time.perf_counter()
    problem = LLMatcher.validate_grammar(lark, tok)
    validate_s = time.perf_counter() - t
    compiles, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        matcher = LLMatcher(tok, lark, log_level=0)
        compiles.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    bitmask = allocate_token_bitmask(1, tok.vocab_size)
    t = time.perf_counter()
    fill_next_token_bitmask(matcher, bitmask)
    first_mask_s = time.perf_counter() - t
    masks = []
    for _ in range(64):  # random walk: any allowed token, EOS when nothing else
        if matcher.is_stopped():
            break
        t = time.perf_counter()
        fill_next_token_bitmask(matcher, bitmask)
        masks.append(time.perf_counter() - t)
        bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[: tok.vocab_size]
        allowed = [int(i) for i in np.flatnonzero(bits) if i not in tok.eos_tokens] or list(tok.eos_tokens)
        if not matcher.consume_token(rng.choice(allowed)):
            break
    masks.sort()
    return {
        "error": problem or matcher.get_error() or None,
        "validate_ms": _ms(validate_s),
        "compile_ms_cold": _ms(compiles[0]),
        "compile_ms_median": _ms(statistics.median(compiles)),
        "compile_cpu_ms_median": _ms(statistics.median(cpu)),  # this process's CPU time: load-independent
        "first_mask_ms": _ms(first_mask_s),
        "mask_us_p50": round(masks[len(masks) // 2] * 1e6, 1) if masks else None,
        "mask_us_p99": round(masks[min(len(masks) - 1, int(len(masks) * 0.99))] * 1e6, 1) if masks else None,
        "walk_tokens": len(masks),
    }


def measure_server_path(lark: str, vocab: Any, vocab_size: int, seeds: int) -> dict[str, Any]:
    from bench.grammar_walk import walk
    from bench.harness.common import percentile
    from constrained.backends import get_backend
    from constrained.spec import DEFAULT_WHITESPACE

    backend = get_backend("llguidance")
    loads, load_cpu, first, first_cpu, step0_cpu, later, later_cpu = [], [], [], [], [], [], []
    for seed in range(seeds):
        text, payload = backend.build("lark", lark, DEFAULT_WHITESPACE, vocab)  # the sandbox worker's part
        t, c = time.perf_counter(), time.thread_time()
        grammar = backend.load("lark", lark, text, payload, vocab, vocab_size, 0.0, 0)  # the scheduler's
        loads.append(time.perf_counter() - t)
        load_cpu.append(time.thread_time() - c)
        cpu: list[float] = []
        first += walk(grammar, vocab, vocab_size, seed, cpu_us=cpu)[1]
        first_cpu += cpu
        step0_cpu.append(cpu[0])
        cpu = []
        later += walk(grammar, vocab, vocab_size, seed, cpu_us=cpu)[1]
        later_cpu += cpu

    def us(values: list[float], q: float) -> float:
        return round(percentile(values, q), 1)

    return {
        "seeds": seeds,
        "load_ms_median": _ms(statistics.median(loads)),
        "load_cpu_ms_median": _ms(statistics.median(load_cpu)),
        "first_mask_cpu_us_median": round(statistics.median(step0_cpu), 1),
        "first_walk_masks": len(first),
        "first_walk_mask_us_p50": us(first, 50),
        "first_walk_mask_us_p99": us(first, 99),
        "first_walk_mask_cpu_us_p50": us(first_cpu, 50),
        "first_walk_mask_cpu_us_p99": us(first_cpu, 99),
        "later_walk_mask_us_p50": us(later, 50),
        "later_walk_mask_us_p99": us(later, 99),
        "later_walk_mask_cpu_us_p50": us(later_cpu, 50),
        "later_walk_mask_cpu_us_p99": us(later_cpu, 99),
    }


def measure_outlines(regex_of, tokenizer: Any, vocab_size: int, timeout_s: float) -> dict[str, Any]:
    from constrained import GrammarCompiler

    t = time.perf_counter()
    try:
        regex = regex_of()
    except ValueError as e:  # a tool's schema refused by the regex schema layer
        return {"outcome": "rejected", "error": str(e)[:300], "build_ms": _ms(time.perf_counter() - t)}
    build_s = time.perf_counter() - t
    limits = dict(workers=1, memory_mb=2048, timeout_s=timeout_s, queue_size=1)
    compiler = GrammarCompiler(tokenizer, vocab_size, pool_limits=limits)
    try:
        t = time.perf_counter()
        try:
            grammar = compiler.compile_async("regex", regex).result()
            out = {"outcome": "ok", "compile_ms": _ms(grammar.compile_seconds)}
        except Exception as e:  # GrammarError / GrammarTimeout: what the server answers
            kind = "timeout" if "time" in str(e).lower() else "error"
            out = {"outcome": kind, "error": str(e)[:300], "wall_s": round(time.perf_counter() - t, 1)}
    finally:
        compiler.shutdown()
    return {**out, "build_ms": _ms(build_s), "regex_chars": len(regex)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="5,6,20,40")
    ap.add_argument("--parser", default="hermes")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--server-seeds", type=int, default=3, help="fresh grammars walked on the server path")
    ap.add_argument("--no-outlines", action="store_true")
    ap.add_argument("--outlines-timeout", type=float, default=60.0)
    ap.add_argument("--out", default="bench/results/tool_grammar.json")
    args = ap.parse_args()

    import llguidance.hf

    from constrained.backends import register_text_tokenizer
    from constrained.vocab import build_vocabulary
    from runtime.entrypoints.tool_calls import grammar as tool_grammar
    from runtime.entrypoints.tool_calls.base import get_parser
    from runtime.entrypoints.tool_calls.schema import ToolChoice, forced_regex, parse_tools
    from runtime.models.model_loader import load_tokenizer, resolve_model_path

    model_dir = resolve_model_path("default")
    hf_tok = load_tokenizer(model_dir)
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    t = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab_size)
    tokenizer_s = time.perf_counter() - t
    vocab = build_vocabulary(hf_tok)
    register_text_tokenizer(vocab, hf_tok)  # as GrammarCompiler does in the scheduler
    parser, choice, rng = get_parser(args.parser), ToolChoice("required"), random.Random(0)
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        tools = parse_tools(tool_set(n))
        builds = []
        for _ in range(args.repeats):
            tool_grammar._memo.clear()
            t = time.perf_counter()
            lark = tool_grammar.forced_lark(parser, tools, choice, True)
            builds.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert tool_grammar.forced_lark(parser, tools, choice, True) is lark
        hit_s = time.perf_counter() - t
        row: dict[str, Any] = {
            "tools": n,
            "lark_chars": len(lark),
            "build_ms_median": _ms(statistics.median(builds)),
            "build_memo_hit_us": round(hit_s * 1e6, 1),
            "llguidance": measure_llguidance(lark, tok, args.repeats, rng),
            "server_path": measure_server_path(lark, vocab, vocab_size, args.server_seeds),
        }
        if not args.no_outlines:
            row["outlines"] = measure_outlines(
                lambda tools=tools: forced_regex(parser, tools, choice, True),
                hf_tok,
                vocab_size,
                args.outlines_timeout,
            )
        print(json.dumps(row), flush=True)
        rows.append(row)
    import llguidance
    import outlines_core

    result = {
        "bench": "tool_grammar",
        "parser": args.parser,
        "tool_choice": "required",
        "parallel_tool_calls": True,
        "model_tokenizer": f"default (SmolLM2-135M, vocab {vocab_size})",
        "llguidance_version": getattr(llguidance, "__version__", "?"),
        "outlines_core_version": getattr(outlines_core, "__version__", "?"),
        "llguidance_tokenizer_build_s": round(tokenizer_s, 2),
        "outlines_timeout_s": args.outlines_timeout,
        "target": "40 tools compile < 100 ms",
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
