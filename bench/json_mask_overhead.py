"""What a JSON-Schema grammar adds to a decode step, in microseconds per decoded token (the `--mask-overhead`
mode of bench/json_schema_coverage.py).

An in-process `Scheduler` (runtime.managers.scheduler; default model, jump-forward off) decodes
`--batch-size` requests twice with the same prompts: unconstrained (ignore_eos, every step a full batch)
and with one JSONSchemaBench schema each. Each decode step (`Scheduler.step`: forward + sampling + grammar
bookkeeping) is timed. The grammar's own work is then replayed on the constrained run's output tokens with
the scheduler's code: `GrammarManager.vocab_mask` (mask fill, [bs, vocab] bool),
`runtime.model_executor.sampler.apply_bans_and_mask` (masked logits) and `GrammarMatcher.accept_token` (cursor
advance). "cold" replays start from a fresh per-state memo (first request of a new schema: every state visited
computes its mask), "warm" replays reuse it (a schema seen before, the steady state of a cache hit). Each
replay runs `--repeats` times; the fastest is reported.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace
from typing import Any

from bench.harness import common
from bench.harness.datasets import chat_prompt, load_subset, sample_rows, schema_text

MASK_SUBSET = "Glaiveai2K"  # function-call schemas: all compile in well under a second


def run_requests(
    sched, prompts: list[list[int]], params: list[dict[str, Any]]
) -> tuple[list[list[int]], list]:
    """Run requests to completion on an in-process scheduler.

    Returns (output ids per request, [(batch size, seconds)] of every decode step). Grammar compiles finish
    before the first step is timed.
    """
    from runtime.messages import GenerateReq
    from runtime.sampling_params import SamplingParams

    for i, (ids, p) in enumerate(zip(prompts, params)):
        sched.handle(GenerateReq(rid=f"r{i}", input_ids=ids, params=SamplingParams(**p)))
    while sched.grammar_wait and not all(r.grammar_future.done() for r in sched.grammar_wait):
        time.sleep(0.02)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    steps = []
    while sched.has_work():
        batch, before = len(sched.running), sched.stats["decode_steps"]
        start = time.perf_counter()
        outs = sched.step()
        seconds = time.perf_counter() - start
        if sched.stats["decode_steps"] > before:
            steps.append((batch, seconds))
        for o in outs:
            if o.error:
                raise RuntimeError(f"request {o.rid} failed: {o.error}")
            del outputs[o.rid][len(outputs[o.rid]) - o.replaced_tokens :]
            outputs[o.rid].extend(o.new_token_ids)
    return [outputs[f"r{i}"] for i in range(len(prompts))], steps


def per_token_us(steps: list[tuple[int, float]], batch_size: int) -> dict[str, Any]:
    """Median µs per token over full-batch decode steps (all steps when none was full)."""
    full = [s for b, s in steps if b == batch_size] or [s / b * batch_size for b, s in steps if b]
    us = [1e6 * s / batch_size for s in full]
    return {"p50": common.percentile(us, 50), "mean": sum(us) / len(us) if us else None, "steps": len(us)}


def replay(grammars: list, outputs: list[list[int]], vocab_size: int) -> dict[str, float]:
    """Seconds spent in mask fill, masked logits and cursor advance when decoding `outputs` again."""
    import torch

    from runtime.managers.scheduler.grammar_manager import GrammarManager
    from runtime.model_executor.sampler import apply_bans_and_mask

    manager = GrammarManager(None, vocab_size)  # only vocab_mask is used: no compiler is built
    reqs = [SimpleNamespace(grammar=g.new_matcher()) for g in grammars]
    logits = torch.randn(len(reqs), vocab_size)  # [bs, vocab]; values do not change the cost
    cpu = torch.device("cpu")
    fill = apply = accept = 0.0
    tokens = 0
    for t in range(max(map(len, outputs))):
        active = [i for i, out in enumerate(outputs) if t < len(out)]
        batch = [reqs[i] for i in active]
        t0 = time.perf_counter()
        mask = manager.vocab_mask(batch, vocab_size, cpu)
        t1 = time.perf_counter()
        apply_bans_and_mask(logits[: len(active)], mask, None)
        t2 = time.perf_counter()
        for i in active:
            reqs[i].grammar.accept_token(outputs[i][t])
        t3 = time.perf_counter()
        fill, apply, accept = fill + t1 - t0, apply + t2 - t1, accept + t3 - t2
        tokens += len(active)
    return {"mask_fill": fill, "masked_logits": apply, "cursor_advance": accept, "tokens": tokens}


def _fresh(grammar):
    """The same compiled automaton with an empty per-state memo."""
    from constrained import CompiledGrammar

    g = grammar
    return CompiledGrammar(g.kind, g.spec, g.regex, g.index, g.vocab, g.vocab_size, g.compile_seconds)


def best_replay(make_grammars, outputs: list[list[int]], vocab_size: int, repeats: int) -> dict[str, float]:
    """µs per token of each component, fastest of `repeats` replays (per component)."""
    runs = [replay(make_grammars(), outputs, vocab_size) for _ in range(max(1, repeats))]
    tokens = runs[0]["tokens"]
    out = {
        k: min(r[k] for r in runs) * 1e6 / tokens for k in ("cursor_advance", "mask_fill", "masked_logits")
    }
    out["grammar_total"] = sum(out.values())
    out["tokens"] = tokens
    return out


def run_mask_overhead(args: argparse.Namespace, env: dict[str, Any]) -> dict[str, Any]:
    import torch

    from runtime.managers.scheduler.scheduler import Scheduler
    from runtime.models.model_loader import load_tokenizer, resolve_model_path
    from runtime.server_args import ServerArgs

    torch.set_num_threads(args.threads or common.usable_cores())
    model_dir = resolve_model_path("default")
    tokenizer = load_tokenizer(model_dir)
    sargs = ServerArgs(model=model_dir, log_interval=0, disable_jump_forward=True, max_total_tokens=16384)
    sched = Scheduler(sargs, model_dir, tokenizer=tokenizer)
    specs = [
        schema_text(r["schema"]) for r in sample_rows(load_subset(MASK_SUBSET), args.batch_size, args.seed)
    ]
    prompts = [tokenizer.encode(chat_prompt(tokenizer, s), add_special_tokens=False) for s in specs]
    greedy = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}
    run_requests(sched, prompts[:2], [{**greedy, "max_new_tokens": 4}] * 2)  # warm-up
    _, plain_steps = run_requests(sched, prompts, [{**greedy, "ignore_eos": True}] * len(prompts))
    outputs, grammar_steps = run_requests(sched, prompts, [{**greedy, "json_schema": s} for s in specs])
    grammars = [sched.grammars.compiler.compile("json_schema", s) for s in specs]  # cache hits
    vocab = sched.runner.vocab_size
    cold = best_replay(lambda: [_fresh(g) for g in grammars], outputs, vocab, args.repeats)
    warm = best_replay(lambda: grammars, outputs, vocab, args.repeats)
    plain = per_token_us(plain_steps, len(prompts))
    constrained = per_token_us(grammar_steps, len(prompts))
    results = {
        "batch_size": len(prompts),
        "schemas": specs,
        "output_tokens": [len(o) for o in outputs],
        "grammar_us_per_token": {"cold": cold, "warm": warm},
        "decode_step_us_per_token": {"unconstrained": plain, "constrained_end_to_end": constrained},
        "overhead_share_of_unconstrained_step": {
            k: common.ratio(v["grammar_total"], plain["p50"]) for k, v in (("cold", cold), ("warm", warm))
        },
    }
    rows = [
        {"component": k, "cold us/token": cold[k], "warm us/token": warm[k]}
        for k in ("cursor_advance", "mask_fill", "masked_logits", "grammar_total")
    ]
    rows.append(
        {
            "component": "decode step, unconstrained",
            "cold us/token": plain["p50"],
            "warm us/token": plain["p50"],
        }
    )
    rows.append(
        {
            "component": "decode step, constrained (e2e)",
            "cold us/token": constrained["p50"],
            "warm us/token": constrained["p50"],
        }
    )
    print()
    common.print_table(
        rows, title=f"== grammar mask overhead, batch {len(prompts)}, {sum(map(len, outputs))} tokens =="
    )
    name = args.name or "json_schema_mask_overhead"
    labels = [r["component"].replace("decode step, ", "step ") for r in rows]
    common.bar_chart(
        common.plot_path(name, args.results_dir),
        labels,
        {"cold": [r["cold us/token"] for r in rows], "warm": [r["warm us/token"] for r in rows]},
        "µs per decoded token",
        f"grammar mask overhead vs decode step (batch {len(prompts)})",
    )
    config = {
        "command": common.command_line(),
        "mode": "mask_overhead",
        "subset": MASK_SUBSET,
        "batch_size": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "jump_forward": False,
        "attention_backend": sched.runner.backend_name,
    }
    common.write_results(name, config, results, env, args.results_dir)
    return results
