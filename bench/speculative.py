"""Speculative decoding: output tok/s with `--speculative-algorithm` none / ngram / suffix, single stream and
batch 8, on four workloads (greedy, the default model, the offline Engine):

(a) `agent`: tool-call JSON turns of an agent (the agent_loop catalogue's tools; earlier calls in context),
(b) `edit`: a ~300-line code file with one change requested, the whole file written back,
(c) `extract`: fields of a document returned as JSON,
(d) `chat`: free chat (nothing to copy: speculation must not cost much here).

Per cell: output tokens / wall seconds over the requests (batch 8: 8 requests submitted together; an agent
turn is ~27 tokens, so its cells run WAVES["agent"] such groups one after another to last long enough to
time; single stream: SINGLE_STREAM_REQUESTS requests one after another), the mean
tokens per verified draft (accepted draft tokens + the sampled one; from the scheduler's counters) and the
draft's cost share (drafting seconds / wall seconds). Each workload runs once unmeasured per engine first
(warm-up) on another request, so the shared index of `suffix` has seen one such request, as it would in a
serving process; then the measured prompts are prefilled once (max_new_tokens 1), so a cell times decoding.
The engines of all algorithms run side by side and every cell is measured --repeats times (free chat:
REPEAT_FACTOR times as many), interleaved across algorithms on new prompts each time; the median counts (the
samples are kept in the JSON).
Two engines of one kind differ by up to +-6 % on the 2-core machine of sessions 39-44 (a constant of each
process), more than drafting costs on free chat at batch 8; `suffix:off` measures the `suffix` engine
itself with speculation off per request, so `speedup_same_engine` holds what drafting costs or gains
without that difference.

    python -m bench.speculative --quick
    python -m bench.speculative --max-new-tokens 256 --workloads agent,edit,extract,chat
    python -m bench.speculative --algorithms none,ngram,suffix,suffix:off,none#control
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from bench import agent_catalogue as cat
from bench.harness import common
from runtime.server_args import ServerArgs

ALGORITHMS = ("none", "ngram", "suffix")
OFF = ":off"  # ALG:off: ALG's engine, every request with speculation off (the same-process baseline)
# groups of `batch` requests per cell, one after another: a batch of 8 agent turns decodes in under a second,
# where one slow step moves the cell by 20-40 % (samples 164-308 tok/s for one side in one run)
WAVES = {"agent": 4}
# repeats per cell, as a multiple of --repeats: free chat's target is a ratio within 3 % of 1, where one cell
# moves by +-3 % from repeat to repeat (its forward alone, in one process), and a median of 3 put
# batch 8 anywhere in 0.93-0.99 from run to run; its cells are the shortest, so 9 cost ~1.5 minutes more
REPEAT_FACTOR = {"chat": 3}
# requests per single-stream cell, one after another: one workload's speedup ranges 0.97x-3x from prompt to
# prompt (edit: 93 / 170 / 294 tok/s for its three samples), so a cell of one request made the
# median one prompt's luck
SINGLE_STREAM_REQUESTS = 4
_SPEC_KEYS = (
    "spec_draft_seconds",
    "spec_verified_drafts",
    "spec_accepted_tokens",
    "spec_verify_steps",
    "decode_steps",
    "generated_tokens",
)


def _agent(i: int) -> list[dict[str, str]]:
    rng = random.Random(i)
    tools = cat.TOOLS[:5]
    names = [t["function"]["name"] for t in tools]
    system = "You are an agent. Answer only with one tool call as JSON. Tools:\n" + json.dumps(tools)
    msgs = [{"role": "system", "content": system}]
    cities = ["Paris", "Berlin", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth"]
    for turn in range(3):
        city = rng.choice(cities)
        msgs.append({"role": "user", "content": f"Check the weather in {city}, in celsius."})
        call = {"name": names[0], "arguments": {"city": city, "unit": "celsius"}}
        msgs.append({"role": "assistant", "content": json.dumps(call)})
        msgs.append({"role": "user", "content": f"Tool result: {{'city': '{city}', 'temp_c': {10 + turn}}}"})
    msgs.append(
        {"role": "user", "content": f"Now the weather in {rng.choice(cities)}, in celsius, then stop."}
    )
    return msgs


def _code_file(i: int, lines: int = 300) -> str:
    rng = random.Random(i)
    out, n = [], 0
    while len(out) < lines:
        name = f"compute_{rng.choice(['total', 'score', 'offset', 'weight'])}_{n}"
        a, b = rng.randrange(2, 9), rng.randrange(10, 99)
        out += [
            f"def {name}(values, factor={a}):",
            f'    """Return the {name.split("_")[1]} of the values scaled by factor."""',
            "    result = 0",
            "    for v in values:",
            f"        result += v * factor + {b}",
            "    return result",
            "",
        ]
        n += 1
    return "\n".join(out[:lines])


def _edit(i: int, lines: int) -> list[dict[str, str]]:
    src = _code_file(i, lines)
    ask = "Rename the parameter `factor` to `scale` in the first function only. Reply with the whole file."
    return [{"role": "user", "content": f"```python\n{src}\n```\n{ask}"}]


def _extract(i: int) -> list[dict[str, str]]:
    rng = random.Random(i)
    name = rng.choice(["Alice Martin", "Bo Chen", "Carla Diaz", "Dev Patel"])
    doc = (
        f"INVOICE 2026-{rng.randrange(1000, 9999)}\nCustomer: {name}\nAddress: {rng.randrange(1, 99)} "
        f"Harbour Street, {rng.choice(['Leeds', 'Porto', 'Graz'])}\nDate: 2026-0{rng.randrange(1, 9)}-1"
        f"{rng.randrange(0, 9)}\nItems: {rng.randrange(2, 9)} x widget at {rng.randrange(5, 50)}.00 EUR\n"
        f"Total due: {rng.randrange(100, 999)}.00 EUR\nNotes: deliver to the side entrance, ring twice.\n"
    ) * 2
    ask = "Extract customer, address, date, items, total and notes from this document as one JSON object."
    return [{"role": "user", "content": doc + "\n" + ask}]


def _chat(i: int) -> list[dict[str, str]]:
    """A different story request for every i < 512 (the warm-up's and every repeat's differ from the rest)."""
    topics = [
        "the sea",
        "a lighthouse",
        "autumn",
        "a train journey",
        "a lost key",
        "the moon",
        "bees",
        "rain",
    ]
    narrators = ["a child", "an old sailor", "a cat", "a robot", "a baker", "a ghost", "a teacher", "a crow"]
    places = ["Lisbon", "a farm", "Mars", "a library", "the desert", "a ferry", "Kyoto", "a hospital"]
    topic, narrator, place = topics[i % 8], narrators[i // 8 % 8], places[i // 64 % 8]
    return [
        {"role": "user", "content": f"Write a short story about {topic}, told by {narrator}, set in {place}."}
    ]


def workload(name: str, i: int, code_lines: int) -> list[dict[str, str]]:
    if name == "agent":
        return _agent(i)
    if name == "edit":
        return _edit(i, code_lines)
    if name == "extract":
        return _extract(i)
    if name == "chat":
        return _chat(i)
    raise ValueError(f"unknown workload {name!r}")


def _counters(engine) -> dict[str, float]:
    info = engine.server_info()
    return {k: float(info.get(k, 0)) for k in _SPEC_KEYS}


def run_cell(engine, prompts: list[str], batch: int, max_new: int, **extra: Any) -> dict[str, Any]:
    params = {"max_new_tokens": max_new, "temperature": 0.0, **extra}
    before = _counters(engine)
    t0 = time.perf_counter()
    tokens = 0
    for at in range(0, len(prompts), batch):
        group = prompts[at : at + batch]
        outs = engine.generate(group, [params] * len(group))
        outs = outs if isinstance(outs, list) else [outs]
        tokens += sum(o["meta_info"]["completion_tokens"] for o in outs)
    wall = time.perf_counter() - t0
    d = {k: v - before[k] for k, v in _counters(engine).items()}
    verified = d["spec_verified_drafts"]
    return {
        "output_tokens": tokens,
        "seconds": round(wall, 3),
        "tok_per_s": round(tokens / wall, 2),
        "accept_length": round((d["spec_accepted_tokens"] + verified) / verified, 3) if verified else None,
        "draft_cost_share": round(d["spec_draft_seconds"] / wall, 4),
        "verify_steps": int(d["spec_verify_steps"]),  # of `decode_steps` forwards, how many verified drafts
        "decode_steps": int(d["decode_steps"]),
    }


def main() -> None:
    common.setup_env()
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="agent,edit,extract,chat")
    p.add_argument("--batches", default="1,8", help="batch sizes (requests submitted together)")
    p.add_argument(
        "--algorithms",
        default=",".join(ALGORITHMS),
        help="ALG or ALG@KV_DTYPE (e.g. none@float16,suffix@bfloat16: KV layouts side by side in one run; "
        "each speedup is against none with the same KV dtype); ALG#TAG adds another engine of that kind "
        "(none#control: its 'speedup' is how far two identical engines differ in this run); ALG:off runs "
        "on ALG's engine with speculation off per request (speculative_num_draft_tokens 0), and ALG's "
        "cells get `speedup_same_engine` against it: what drafting costs or gains within one process",
    )
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument(
        "--requests",
        type=int,
        default=0,
        help="requests per cell (default: the batch size x WAVES; single stream: SINGLE_STREAM_REQUESTS)",
    )
    p.add_argument("--code-lines", type=int, default=300)
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=ServerArgs.speculative_num_draft_tokens,
        help="the server's default",
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="interleaved runs per cell (chat: x REPEAT_FACTOR); the median counts",
    )
    p.add_argument(
        "--max-total-tokens", type=int, default=32768, help="KV pool of each engine (all run at once)"
    )
    a = p.parse_args()
    if a.quick:
        a.max_new_tokens, a.code_lines, a.repeats = min(a.max_new_tokens, 48), min(a.code_lines, 60), 1
    from runtime.engine import Engine

    workloads, batches = common.csv_list(a.workloads), common.csv_list(a.batches, int)
    algorithms = common.csv_list(a.algorithms)
    env = common.environment()
    results: dict[str, Any] = {}
    # Every algorithm's engine lives for the whole run and the cells interleave (rotating which goes first),
    # so load that drifts over minutes on a shared machine lands on every side alike; each side's figure is
    # its median over --repeats, and each repeat decodes new prompts, so no engine has seen the outputs.
    engines: dict[str, Any] = {}
    off = {alg: alg.removesuffix(OFF) for alg in algorithms if alg.endswith(OFF)}  # ALG:off -> ALG
    if not set(off.values()) <= set(algorithms):
        p.error(f"ALG{OFF} runs on ALG's engine: list ALG too ({', '.join(off)})")
    try:
        for alg in algorithms:
            if alg in off:
                continue
            name, _, kv = alg.partition("@")
            name = name.partition("#")[0]  # none#control: a second engine of the same kind
            engines[alg] = Engine(
                speculative_algorithm=name,
                speculative_num_draft_tokens=a.num_draft_tokens,
                dtype=a.dtype,
                kv_cache_dtype=kv or "auto",
                max_total_tokens=a.max_total_tokens,
                log_interval=0,
            )
        tok = next(iter(engines.values())).tokenizer

        def chat(wl: str, ids: range) -> list[str]:
            return [
                tok.apply_chat_template(
                    workload(wl, i, a.code_lines), add_generation_prompt=True, tokenize=False
                )
                for i in ids
            ]

        for wl in workloads:
            next_id = 0  # every measured prompt of a workload is new to every engine (batch sizes too)
            for bs in batches:
                n = a.requests or bs * max(WAVES.get(wl, 1), SINGLE_STREAM_REQUESTS if bs == 1 else 1)
                # warm-up: another request of the workload (what suffix's shared index has seen)
                for engine in engines.values():
                    run_cell(engine, chat(wl, range(1000, 1001)), 1, a.max_new_tokens)
                samples: dict[str, list[dict[str, Any]]] = {alg: [] for alg in algorithms}
                for r in range(a.repeats * REPEAT_FACTOR.get(wl, 1)):
                    prompts = chat(wl, range(next_id, next_id + n))
                    next_id += n
                    order = algorithms[r % len(algorithms) :] + algorithms[: r % len(algorithms)]
                    for alg in order:
                        engine = engines[off.get(alg, alg)]
                        extra = {"speculative_num_draft_tokens": 0} if alg in off else {}
                        run_cell(engine, prompts, bs, 1, **extra)  # prefill (cached): the cell times decoding
                        samples[alg].append(run_cell(engine, prompts, bs, a.max_new_tokens, **extra))
                for alg, cells in samples.items():
                    cell = sorted(cells, key=lambda c: c["tok_per_s"])[len(cells) // 2]
                    cell = {
                        **cell,
                        "tok_per_s_samples": [c["tok_per_s"] for c in cells],
                        "verify_steps_samples": [c["verify_steps"] for c in cells],
                    }
                    results.setdefault(wl, {}).setdefault(f"batch{bs}", {})[alg] = cell
                    print(wl, f"batch {bs}", alg, cell, flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    for by_bs in results.values():
        for cells in by_bs.values():
            for alg, cell in cells.items():
                kv = alg.partition("@")[2]
                base = cells.get(f"none@{kv}" if kv else "none", {}).get("tok_per_s")
                cell["speedup"] = round(cell["tok_per_s"] / base, 3) if base else None
                same = cells.get(alg + OFF, {}).get("tok_per_s")
                if same:
                    cell["speedup_same_engine"] = round(cell["tok_per_s"] / same, 3)
    config = {"command": common.command_line(), **vars(a)}
    name = a.name or ("speculative_quick" if a.quick else "speculative")
    common.write_results(name, config, results, env, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
