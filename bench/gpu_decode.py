"""Decode throughput on an NVIDIA GPU: every attention backend, with and without CUDA graphs, against HF
`generate`, plus the whole Engine (scheduler, radix cache, a JSON-schema request) on the same device.

Each backend side is a `ModelRunner` on `--device cuda` timed by `bench.decode_throughput.radixlm_decode`
(prefill `bs` random prompts, then greedy decode steps; the per-step `.tolist()` synchronises, so the time
is what a scheduler would see). `--random-weights` swaps the model's weights for random ones of the same
shapes, written next to a copy of its config and tokenizer: the work per token does not depend on the
values, and a machine that cannot receive the 100 MB default model can still be measured (the figures then
say so). The Engine part checks correctness on the device rather than speed: greedy outputs equal between
two backends, a JSON-schema request returns valid JSON, and no KV is left.

    python -m bench.gpu_decode --model default
    python -m bench.gpu_decode --model /path/to/config-and-tokenizer --random-weights --quick
"""

from __future__ import annotations

import gc
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.decode_throughput import hf_decode, median_run, radixlm_decode
from bench.harness import common

common.setup_env()

import torch  # noqa: E402

BACKENDS = ("flashinfer", "triton", "torch_native")
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def random_weights_model(src: str, dst: Path, dtype: torch.dtype) -> str:
    """A Hugging Face folder with `src`'s config and tokenizer and random weights of the same shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dst.mkdir(parents=True, exist_ok=True)
    for name in (*MODEL_FILES, "chat_template.jinja"):
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, dst / name)
    config = AutoConfig.from_pretrained(src)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(dst)
    del model
    gc.collect()
    return str(dst)


def backend_sides(args: Any) -> list[tuple[str, bool]]:
    """(backend, cuda graphs) pairs to measure; graphs only where the backend supports capture."""
    sides = []
    for backend in common.csv_list(args.backends):
        sides.append((backend, False))
        if backend != "torch_native":
            sides.append((backend, True))
    return sides


def measure_runner(model_dir: str, args: Any, backend: str, graphs: bool, gen: torch.Generator) -> dict:
    """Decode rates of one ModelRunner configuration at every batch size (median of --repeats)."""
    from runtime.model_executor.model_runner import ModelRunner

    batch_sizes = common.csv_list(args.batch_sizes, int)
    max_bs = max(batch_sizes)
    t0 = time.perf_counter()
    runner = ModelRunner(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        max_total_tokens=max_bs * (args.prompt_len + args.decode_steps) + 64,
        max_running_requests=max_bs,
        attention_backend=backend,
        disable_cuda_graph=not graphs,
    )
    out: dict[str, Any] = {"load_and_capture_s": time.perf_counter() - t0, "backend": runner.backend_name}
    out["cuda_graphs"] = runner.graph_runner is not None
    radixlm_decode(runner, min(2, max_bs), 16, 2, gen)  # warm-up: first-call allocations, JIT, autotuning
    per_bs = {}
    for bs in batch_sizes:
        samples = [
            radixlm_decode(runner, bs, args.prompt_len, args.decode_steps, gen) for _ in range(args.repeats)
        ]
        per_bs[str(bs)] = median_run(samples)
    out["batch_sizes"] = per_bs
    del runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def measure_hf(model_dir: str, args: Any, gen: torch.Generator) -> dict:
    from bench.harness.hf_model import load_hf_model

    model, _, load_s = load_hf_model(model_dir, args.dtype, args.device)
    hf_decode(model, 2, 16, 3, gen)
    per_bs = {}
    for bs in common.csv_list(args.batch_sizes, int):
        samples = [hf_decode(model, bs, args.prompt_len, args.decode_steps, gen) for _ in range(args.repeats)]
        per_bs[str(bs)] = median_run(samples)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"load_s": load_s, "batch_sizes": per_bs}


def _find(tree: Any, key: str) -> Any:
    """The first value under `key` anywhere in nested dicts/lists (server_info nests per replica)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for item in tree:
            if (found := _find(item, key)) is not None:
                return found
    return None


def engine_check(model_dir: str, args: Any, backends: list[str]) -> dict:
    """The whole runtime on the GPU: equal greedy outputs across backends, a constrained request, no leak."""
    from runtime import Engine

    prompts = [f"Question {i}: list three facts about the number {i}." for i in range(16)]
    greedy = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    out: dict[str, Any] = {}
    texts = {}
    for backend in backends:
        t0 = time.perf_counter()
        engine = Engine(
            model=model_dir,
            device=args.device,
            dtype=args.dtype,
            attention_backend=backend,
            log_level="warning",
        )
        res: dict[str, Any] = {"start_s": time.perf_counter() - t0}
        try:
            t0 = time.perf_counter()
            outs = engine.generate(prompts, sampling_params=greedy)
            res["batch16_s"] = time.perf_counter() - t0
            texts[backend] = [o["text"] for o in outs]
            shared = [("You are a careful assistant. " * 40) + f"Task {i}." for i in range(32)]
            t0 = time.perf_counter()
            outs = engine.generate(shared, sampling_params={**greedy, "max_new_tokens": 64})
            dt = time.perf_counter() - t0
            res["shared_prefix_32x64"] = {
                "s": dt,
                "out_tok_s": 32 * 64 / dt,
                "cached_tokens": sum(o["meta_info"].get("cached_tokens", 0) for o in outs),
            }
            constrained = engine.generate(
                "Give a person as JSON:",
                sampling_params={"max_new_tokens": 64, "temperature": 0, "json_schema": json.dumps(schema)},
            )
            # bounded fields, so the grammar ends well inside max_new_tokens (an unbounded integer let a
            # random-weights model write digits until the length limit)
            text, finish = constrained["text"], constrained["meta_info"].get("finish_reason")
            check: dict[str, Any] = {"text": text, "finish_reason": finish}
            try:
                value = json.loads(text)
                check["valid"] = set(value) == {"name", "age"} and 0 <= value["age"] <= 150
            except ValueError as e:
                check.update(valid=False, error=str(e))
            res["json_schema"] = check
            res["request_held_tokens_after"] = _find(engine.server_info(), "request_held_tokens")
        except Exception as e:  # record and go on to the next backend
            res["error"] = f"{type(e).__name__}: {e}"
        finally:
            engine.shutdown()
        out[backend] = res
    if len(texts) >= 2:
        first, *rest = texts
        out["greedy_equal_across_backends"] = {
            b: sum(x == y for x, y in zip(texts[first], texts[b], strict=True)) / len(prompts) for b in rest
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="default, a GGUF file or a Hugging Face folder")
    p.add_argument("--random-weights", action="store_true", help="random weights of the model's shapes")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--batch-sizes", default="1,8,32,64,128")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cuda", help="cpu only to dry-run this script without a GPU")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-engine", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.decode_steps, args.repeats = "1,8,64", 32, 1
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(
            "no CUDA device: this benchmark measures the GPU path (bench/decode_throughput.py is the CPU one)"
        )
    from runtime.models.model_loader import resolve_model_path

    tmp = Path(tempfile.mkdtemp(prefix="radixlm-gpu-"))
    if args.random_weights:
        model_dir = random_weights_model(args.model, tmp / "model", getattr(torch, args.dtype))
    else:
        model_dir = resolve_model_path(args.model)
    gen = torch.Generator().manual_seed(0)
    results: dict[str, Any] = {"sides": {}, "random_weights": args.random_weights}
    rows = []

    def add_rows(side: str, res: dict) -> None:
        for bs, r in res.get("batch_sizes", {}).items():
            rows.append(
                {
                    "side": side,
                    "bs": int(bs),
                    "decode tok/s": r.get("decode_tok_s"),
                    "step ms": r.get("step_ms")
                    or (1000 * int(bs) / r["decode_tok_s"] if r.get("decode_tok_s") else None),
                    "prefill tok/s": r.get("prefill_tok_s"),
                }
            )

    for backend, graphs in backend_sides(args):
        side = f"{backend}{'+graphs' if graphs else ''}"
        try:
            res = measure_runner(model_dir, args, backend, graphs, gen)
        except Exception as e:  # one backend failing must not hide the others' figures
            res = {"error": f"{type(e).__name__}: {e}"}
            print(f"{side}: {res['error']}", flush=True)
        results["sides"][side] = res
        add_rows(side, res)
        print(common.format_table([r for r in rows if r["side"] == side]) if rows else side, flush=True)
    if not args.no_hf:
        try:
            results["sides"]["hf"] = measure_hf(model_dir, args, gen)
            add_rows("hf", results["sides"]["hf"])
        except Exception as e:
            results["sides"]["hf"] = {"error": f"{type(e).__name__}: {e}"}
    if not args.no_engine:
        ok = [b for b in common.csv_list(args.backends) if "error" not in results["sides"].get(b, {})][:2]
        results["engine"] = engine_check(model_dir, args, ok)
        print(json.dumps(results["engine"], indent=1, default=str), flush=True)
    common.print_table(rows, title=f"== GPU decode ({args.dtype}, prompt {args.prompt_len}) ==")
    config = {k: v for k, v in vars(args).items()}
    config["device_name"] = torch.cuda.get_device_name(0) if args.device == "cuda" else common.cpu_model()
    config["torch"] = torch.__version__
    shutil.rmtree(tmp, ignore_errors=True)
    common.write_results(args.name or "gpu_decode", config, results, results_dir=args.results_dir)
    return results


if __name__ == "__main__":
    main()
