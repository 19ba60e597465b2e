"""What every benchmark shares: the environment record, result files, plots, tables, timing and statistics.

A result file `bench/results/<name>.json` holds `config` (the exact command and options), `environment`
(CPU, cores, torch/transformers versions and threads, git commit, load average before and after) and
`results` (every figure). Timings on a shared machine are noisy: the load average is recorded so that a
reader can tell a quiet run (1-minute load < QUIET_LOAD) from a contended one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]  # bench/harness/common.py -> the repository
RESULTS_DIR = REPO_ROOT / "bench" / "results"
QUIET_LOAD = 1.5  # 1-minute load average below which the machine counts as quiet


def setup_env() -> None:
    """Offline model hub, no tokenizer fork warnings; call before importing transformers."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ------------------------------------------------------------------------------------------ environment
# the ISA flags a result states with its machine: they decide which kernels ran (AVX-512 or AVX2 loops,
# w4a8's VNNI path, native bf16, AMX tiles)
REPORTED_CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def load_average() -> dict[str, float | bool]:
    one, five, fifteen = os.getloadavg()
    return {
        "load_1m": round(one, 2),
        "load_5m": round(five, 2),
        "load_15m": round(fifteen, 2),
        "quiet": one < QUIET_LOAD,
    }


def git_commit() -> dict[str, Any]:
    """HEAD and whether tracked files differ from it (read-only git calls)."""

    def run(*cmd: str) -> str:
        try:
            return subprocess.run(
                ["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": run("rev-parse", "HEAD") or None,
        "dirty": bool(run("status", "--porcelain", "--untracked-files=no")),
    }


def environment() -> dict[str, Any]:
    import torch

    from runtime.platform import cpu_flags

    env: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_cores": usable_cores(),
        "cpu_flags": sorted(f for f in cpu_flags() if f in REPORTED_CPU_FLAGS),  # which kernels ran
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "git": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


# ------------------------------------------------------------------------------------------ statistics
def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99, min, max and n of a sample (NaN figures when it is empty)."""
    vals = [float(v) for v in values]
    n = len(vals)
    return {
        "mean": sum(vals) / n if n else math.nan,
        "p50": percentile(vals, 50),
        "p90": percentile(vals, 90),
        "p99": percentile(vals, 99),
        "min": min(vals) if n else math.nan,
        "max": max(vals) if n else math.nan,
        "n": n,
    }


def decode_figures(t1: float, tn: float, bs: int, prompt_len: int, steps: int) -> dict[str, float | None]:
    """Decode speed from two timed generations of `bs` prompts: 1 token (`t1`: prefill and set-up) and
    `steps` tokens (`tn`); the difference is steps - 1 decode steps."""
    return {
        "t1_s": t1,
        "tN_s": tn,
        "prefill_tok_s": bs * prompt_len / t1,
        "decode_tok_s": bs * (steps - 1) / (tn - t1) if tn > t1 else None,
        "step_ms": 1000 * (tn - t1) / (steps - 1) if steps > 1 else None,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where it is undefined (missing, zero or NaN denominator)."""
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


class Timer:
    """`with Timer() as t: ...` then `t.seconds` (perf_counter wall time)."""

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        self.seconds = math.nan
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


# ------------------------------------------------------------------------------------------ tables
def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value == 0:
            return "0"
        mag = abs(value)
        if mag >= 1000:
            return f"{value:,.0f}"
        if mag >= 100:
            return f"{value:.1f}"
        if mag >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def format_table(
    rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, title: str | None = None
) -> str:
    """A fixed-width text table; `columns` defaults to the keys of all rows in first-seen order."""
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    for r in cells:
        lines.append("  ".join(v.rjust(w) if _numeric(v) else v.ljust(w) for v, w in zip(r, widths)))
    return "\n".join(lines)


def _numeric(text: str) -> bool:
    return bool(text) and (text[0].isdigit() or text[0] in "-+.") and text != "-"


def print_table(
    rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, title: str | None = None
) -> None:
    print(format_table(rows, columns, title), flush=True)


# ------------------------------------------------------------------------------------------ result files
def write_results(
    name: str,
    config: dict[str, Any],
    results: dict[str, Any],
    env: dict[str, Any] | None = None,
    results_dir: Path | str | None = None,
) -> Path:
    """Write `<results_dir>/<name>.json` (config, environment, results) and return its path."""
    out_dir = Path(results_dir) if results_dir else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(env or environment())
    env["load_after"] = load_average()
    doc = {"name": name, "config": config, "environment": env, "results": results}
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False, default=_json_default) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}", flush=True)
    return path


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def command_line() -> str:
    """The command as typed: `python -m bench.<name> ...` (not the module's absolute file path)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    entry = ["-m", spec.name] if spec is not None and spec.name else sys.argv[:1]
    return " ".join([Path(sys.executable).name, *entry, *sys.argv[1:]])


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_chart(
    path: Path | str,
    groups: Sequence[str],
    series: dict[str, Sequence[float | None]],
    ylabel: str,
    title: str,
) -> Path:
    """Grouped bars: one group per entry of `groups`, one bar per series (None draws nothing)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(groups) * max(1, len(series)) * 0.6 + 2), 3.6))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ys = [math.nan if v is None else v for v in values]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def line_chart(
    path: Path | str,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    hlines: dict[str, float] | None = None,
) -> Path:
    """One line per series `{label: (xs, ys)}`; optional dashed horizontal reference lines."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    for label, y in (hlines or {}).items():
        ax.axhline(y, linestyle="--", linewidth=0.8, color="gray")
        ax.annotate(label, (0.01, y), xycoords=("axes fraction", "data"), fontsize=7, va="bottom")
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig: Any, path: Path | str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_path(name: str, results_dir: Path | str | None = None) -> Path:
    return (Path(results_dir) if results_dir else RESULTS_DIR) / f"{name}.png"


# ------------------------------------------------------------------------------------------ CLI
def base_parser(description: str) -> argparse.ArgumentParser:
    """Options every benchmark has: --quick, --results-dir, --name."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small sizes: checks that everything runs")
    p.add_argument("--results-dir", default=str(RESULTS_DIR), help="where the JSON and PNG go")
    p.add_argument("--name", default=None, help="result file stem (default: the script's name)")
    return p


def csv_list(text: str, cast: type = str) -> list[Any]:
    """'1,8,32' -> [1, 8, 32] (with cast=int); blanks dropped."""
    return [cast(x.strip()) for x in text.split(",") if x.strip()]
