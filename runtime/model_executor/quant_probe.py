"""`--quantization auto` for a Hugging Face folder nobody measured: measure, once, which quantized mode agrees
with the model's own float32, and cache the answer with the model.

The measure: next-token top-1 agreement, teacher-forced. The probe text (data/probe_text.txt: prose, a
recipe, Python, JSON, SQL, a shell log, JavaScript, HTML, a support dialogue, a tool call and its result, a
table, numbers and dates; 3,828 tokens under SmolLM2's tokenizer) is cut into windows of `WINDOW` tokens;
each window is one extend forward from position 0 through the real `ModelRunner`, first in float32 without
quantization (the reference), then in each candidate mode, fastest first, and the argmax of every position
is compared. The first mode whose agreement is >= `MIN_TOP1_AGREEMENT` (0.99) is chosen; the modes after it
are not measured. None passing: `none`.

Cost is bounded by the model's size: the windows used hold about `TOKEN_PARAMS / parameters` tokens, between
`MIN_TOKENS` and `MAX_TOKENS`, spread evenly over the text (every kind of text is seen), and a mode's pass
stops at the first window after which 0.99 is out of reach. Each mode is a load (the float32 weights,
quantized) and a pass. Measured on the 2-core EPYC while other jobs kept it at a load average of ~8:
SmolLM2-135M's float folder 114 s, a random Llama-3.2-1B-shaped folder 197 s (512 tokens; 53-56 s of it
each quantizing load); docs/numerics.md has the figures and the command.

The cache: `radixlm_quantization.json` beside the weights where that folder is writable (by its mode bits,
for root too), else `<cache root>/quantization/<hash of the folder's path>.json` (runtime.cache_dir:
$RADIXLM_CACHE_DIR or ~/.cache/radixlm). An entry is used only when its key matches: the weights'
fingerprint (`model_loader.weights_fingerprint`: config, sizes, headers and samples of the data) and each
weight file's size and modification time, radixlm's version, a hash of the quantized kernels' sources and
of this module, torch's version, the CPU flags the kernels depend on, the candidates, the probe text and
the bound. Anything else (new weights, another CPU) is measured again.

Where it runs: in the process that resolves `ServerArgs` with this probe (`radixlm serve` before it starts
the scheduler and tensor-parallel ranks, which receive the resolved choice; `Engine`; the data-parallel front
before it starts its replicas, which then read the cache). Not for GGUF files, the MEASURED models or
multi-node runs (runtime/models/quantization.py decides that).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from runtime.models.quantization import MIN_TOP1_AGREEMENT

logger = logging.getLogger("radixlm.quant_probe")

PROBE_TEXT = Path(__file__).parent / "data" / "probe_text.txt"
WINDOW = 256  # tokens per forward
MIN_TOKENS, MAX_TOKENS = 512, 2048
TOKEN_PARAMS = 512 * 1.2e9  # tokens x parameters per pass: a 1.2B model reads 512 tokens, 300M and less 2048
CACHE_FILE = "radixlm_quantization.json"
CACHE_FORMAT = 1
KEY_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16")
# sources whose change can change a quantized mode's logits, or how they are measured
_KERNEL_SOURCES = (
    "models/csrc/w4a8_gemm.cpp",
    "models/w4a8.py",
    "models/quantized_linear.py",
    "model_executor/quant_probe.py",
)


class NotMeasurable(ValueError):
    """The folder cannot be measured (its tokenizer's ids do not fit its vocabulary, say)."""


# ----------------------------------------------------------------------------------------------- the answer
def auto_quantization(model_dir: str, candidates: Sequence[str]) -> tuple[str, str]:
    """(quantization, why) for `model_dir` under `--quantization auto`: the cached answer when its key still
    matches, else a fresh measurement (cached). `candidates`: the modes that run fast here, fastest first."""
    from runtime.models.model_config import ModelConfig
    from runtime.models.model_loader import load_hf_config
    from runtime.models.registry import model_class_for

    arch = ModelConfig.from_hf(load_hf_config(model_dir)).architecture
    if not getattr(
        model_class_for(arch), "quantizable", True
    ):  # measuring would load it in float32 for nothing
        return "none", f"quantization auto: {arch} is served from its float weights only; chose none"
    key = cache_key(model_dir, candidates)
    for path in cache_paths(model_dir):
        entry = _read(path)
        if entry is not None and entry.get("key") == key:
            return entry["chosen"], describe(entry, f"cached in {path}, measured {entry['measured_at']}")
    logger.info(
        "quantization auto: measuring %s against float32 on the probe text (once for these weights)",
        ", ".join(candidates),
    )
    try:
        entry = measure(model_dir, candidates)
    except NotMeasurable as e:
        return "none", f"quantization auto: {model_dir} cannot be measured ({e}); chose none"
    entry.update(key=key, measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    where = _write(model_dir, entry)
    cached = f"cached in {where}" if where else "not cached: no writable cache directory"
    return entry["chosen"], describe(entry, f"measured in {entry['seconds']:.1f} s, {cached}")


def describe(entry: dict[str, Any], how: str) -> str:
    """The start-up log's line: every figure, the choice, and where it came from."""
    agreement: dict[str, float] = entry["agreement"]
    chosen = entry["chosen"]
    tokens = f"{entry['tokens']:,} probe tokens"
    if chosen != "none":
        others = [f"{m} {a:.3f}{_partial(entry, m)}" for m, a in agreement.items() if m != chosen]
        head = f"{chosen} agrees {agreement[chosen]:.3f} with float32 on {tokens}"
    else:
        others = []
        head = " ".join(f"{m} {a:.3f}{_partial(entry, m)}," for m, a in agreement.items()).rstrip(",")
        head = f"{head or 'no mode'} agrees with float32 on {tokens}, below {entry['bound']}"
    others += [f"{m} failed: {why}" for m, why in entry["failed"].items()]
    extra = f" ({'; '.join(others)})" if others else ""
    return f"quantization auto: {head}{extra}; chose {chosen} ({how})"


def _partial(entry: dict[str, Any], mode: str) -> str:
    n = entry.get("stopped_after", {}).get(mode)
    return f" (stopped after {n:,} tokens)" if n else ""


# ----------------------------------------------------------------------------------------------- measuring
def measure(
    model_dir: str, candidates: Sequence[str], bound: float = MIN_TOP1_AGREEMENT, stop_early: bool = True
) -> dict[str, Any]:
    """Top-1 agreement of each candidate with float32 until one reaches `bound`; the cache entry (no key).
    `stop_early=False` runs every window of a failing mode too (the full figure, for reports)."""
    from runtime.models.model_config import ModelConfig
    from runtime.models.model_loader import load_hf_config, load_tokenizer
    from runtime.platform import auto_num_threads

    t0 = time.perf_counter()
    cfg = ModelConfig.from_hf(load_hf_config(model_dir))
    window = min(WINDOW, cfg.max_position_embeddings)
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer(PROBE_TEXT.read_text(), add_special_tokens=False)["input_ids"]
    bos = (
        [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    )  # each window starts as text does
    if max(ids + bos) >= cfg.vocab_size:
        raise NotMeasurable(f"its tokenizer gives ids up to {max(ids)}, its vocabulary has {cfg.vocab_size}")
    step = window - len(bos)
    windows = [bos + ids[i : i + step] for i in range(0, len(ids) - step + 1, step)]
    threads = torch.get_num_threads()
    torch.set_num_threads(auto_num_threads())
    try:
        runner = _runner(model_dir, "none", window)
        params = sum(p.numel() for p in runner.model.parameters())
        windows = _spread(windows, int(TOKEN_PARAMS / max(params, 1)) // window)
        reference = _top1(runner, windows)
        del runner
        _release()
        agreement: dict[str, float] = {}
        failed: dict[str, str] = {}
        stopped: dict[str, int] = {}  # mode -> tokens measured, where it stopped early
        chosen = "none"
        for mode in candidates:
            t = time.perf_counter()
            try:
                runner = _runner(model_dir, mode, window)
                # a mode stops as soon as it cannot reach the bound any more: most of a failing pass is saved
                allowed = int((1 - bound) * reference.numel() + 1e-9)
                got = _top1(runner, windows, reference if stop_early else None, allowed)
            except (ValueError, RuntimeError) as e:  # a shape the kernel refuses, a kernel that did not build
                failed[mode] = str(e).splitlines()[0][:200]
                continue
            finally:
                runner = None
                _release()
            agreement[mode] = round((got == reference[: got.numel()]).float().mean().item(), 4)
            if got.numel() < reference.numel():
                stopped[mode] = got.numel()
            logger.info(
                "quantization auto: %s agrees %.4f with float32 on %d tokens (%.1f s)",
                mode,
                agreement[mode],
                got.numel(),
                time.perf_counter() - t,
            )
            if agreement[mode] >= bound:
                chosen = mode
                break
    finally:
        torch.set_num_threads(threads)
    return {
        "format": CACHE_FORMAT,
        "chosen": chosen,
        "agreement": agreement,
        "failed": failed,
        "bound": bound,
        "tokens": int(reference.numel()),
        "stopped_after": stopped,
        "parameters": params,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _spread(windows: list[list[int]], n: int) -> list[list[int]]:
    """`n` (clamped to MIN_TOKENS..MAX_TOKENS worth) of `windows`, evenly spaced from first to last."""
    per = len(windows[0]) if windows else 1
    n = max(MIN_TOKENS // per, min(n, MAX_TOKENS // per))
    if n >= len(windows):
        return windows
    if n <= 1:
        return windows[:1]
    return [windows[round(i * (len(windows) - 1) / (n - 1))] for i in range(n)]


def _runner(model_dir: str, quantization: str, window: int):
    """A float32 `ModelRunner` of one request of `window` tokens (float32 KV: only the weights differ)."""
    from runtime.model_executor.model_runner import ModelRunner

    return ModelRunner(
        model_dir,
        dtype="float32",
        kv_cache_dtype="float32",
        device="cpu",
        max_total_tokens=window,
        max_running_requests=1,
        context_length=window,
        quantization=quantization,
    )


def _top1(
    runner, windows: list[list[int]], reference: torch.Tensor | None = None, allowed: int = 0
) -> torch.Tensor:
    """The argmax token at every position of every window [sum of window lengths], one forward a window;
    with a `reference`, it stops after the first window that brings the mismatches above `allowed`."""
    from runtime.model_executor.forward_batch import ForwardBatch

    row = runner.req_to_token_pool.alloc()
    slots = runner.allocator.alloc(max(len(w) for w in windows))
    out = []
    with torch.inference_mode():
        for w in windows:  # each from position 0: the slots are overwritten, never read before written
            runner.req_to_token_pool.write(row, 0, slots[: len(w)])
            batch = ForwardBatch.build_extend(
                [w], [0], [row], slots[: len(w)], logits_indices=list(range(len(w)))
            )
            out.append(runner.forward(batch).argmax(-1))
            if reference is not None:
                got = torch.cat(out)
                if int((got != reference[: got.numel()]).sum()) > allowed:
                    break
    runner.allocator.free(slots)
    runner.req_to_token_pool.free(row)
    return torch.cat(out)


def _release() -> None:
    from runtime import allocator

    gc.collect()
    allocator.trim()


# ----------------------------------------------------------------------------------------------- the cache
def cache_key(model_dir: str, candidates: Sequence[str]) -> dict[str, Any]:
    """Everything a cached answer depends on; a cached entry is used only when it is equal."""
    from runtime.models.model_loader import weights_fingerprint
    from runtime.platform import cpu_flags

    root = Path(__file__).resolve().parents[1]
    kernels = hashlib.sha256()
    for rel in _KERNEL_SOURCES:
        p = root / rel
        kernels.update(p.read_bytes() if p.is_file() else b"")
    envs = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("RADIXLM_W4A8_"))
    flags = cpu_flags()
    folder = Path(model_dir)
    files = sorted(p for p in (*folder.glob("*.safetensors"), folder / "config.json") if p.is_file())
    return {
        "weights": weights_fingerprint(model_dir),
        # a rewritten file, even where the fingerprint's samples miss the change (a small tensor)
        "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files},
        "radixlm": _version(),
        "kernels": kernels.hexdigest()[:16],
        "kernel_env": envs,
        "torch": torch.__version__,
        "cpu_flags": [f for f in KEY_FLAGS if f in flags],
        "candidates": list(candidates),
        "probe": hashlib.sha256(PROBE_TEXT.read_bytes()).hexdigest()[:16],
        "bound": MIN_TOP1_AGREEMENT,
        "window": WINDOW,
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("radixlm")
    except PackageNotFoundError:
        return "unknown"


def cache_paths(model_dir: str) -> list[Path]:
    """Where an answer may be: beside the weights, then the user cache (read in this order)."""
    return [Path(model_dir) / CACHE_FILE, _user_cache_path(model_dir)]


def user_cache_dir() -> Path:
    """`<cache root>/quantization`: answers for folders that cannot be written."""
    from runtime.cache_dir import cache_root

    return cache_root() / "quantization"


def _user_cache_path(model_dir: str) -> Path:
    name = hashlib.sha256(os.path.realpath(model_dir).encode()).hexdigest()[:24]
    return user_cache_dir() / f"{name}.json"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) and entry.get("format") == CACHE_FORMAT else None


def writable(folder: Path) -> bool:
    """Whether `folder` may be written: a writable mount and a write bit for us in its mode. Root passes
    os.access on any folder, so the mode bits are read too: a folder made read-only stays untouched."""
    try:
        st = os.stat(folder)
        if os.statvfs(folder).f_flag & os.ST_RDONLY or not os.access(folder, os.W_OK):
            return False
    except OSError:
        return False
    if st.st_uid == os.geteuid():
        return bool(st.st_mode & stat.S_IWUSR)
    if st.st_gid in os.getgroups():
        return bool(st.st_mode & stat.S_IWGRP)
    return bool(st.st_mode & stat.S_IWOTH)


def _write(model_dir: str, entry: dict[str, Any]) -> Path | None:
    """Write `entry` beside the weights, or where that folder is read-only, to the user cache; atomically
    (concurrent starts each rename a whole file). Returns the path, or None when neither could be written."""
    from runtime.cache_dir import UnsafeCacheDir, private_dir

    text = json.dumps(entry, indent=1, sort_keys=True)
    folder = Path(model_dir)
    targets = [folder / CACHE_FILE] if writable(folder) else []
    targets.append(_user_cache_path(model_dir))
    for target in targets:
        try:
            if target.parent != folder:
                private_dir(target.parent)  # 0700, ours
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o644 if target.parent == folder else 0o600)
            os.replace(tmp, target)
            return target
        except (OSError, UnsafeCacheDir) as e:
            logger.warning("quantization auto: could not cache the measurement in %s (%s)", target, e)
    return None
