"""Loaders of the data sets the benchmarks and tests read, all kept in the repository under bench/data/.

Nothing here reads outside the repository: every path defaults to DATA_DIR (bench/data; files, sources and
licences in bench/data/README.md). A loader takes `data_dir` so that a test can point it at a small copy.
The JSONSchemaBench prompt helpers live here too, because json_schema_coverage and json_mask_overhead send
the same prompts.
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parents[1] / "data"

MMLU_SUBJECTS = ("clinical_knowledge", "global_facts", "high_school_physics", "machine_learning", "nutrition")
MMLU_LETTERS = "ABCD"
GSM8K_SPLITS = ("train_head200", "test")
JSONSCHEMABENCH_SUBSETS = ("Github_trivial", "Github_easy", "Glaiveai2K")
JSON_SYSTEM_PROMPT = "You convert text into JSON that follows the given schema."


def iter_jsonl(path: Path | str) -> Iterable[dict[str, Any]]:
    """One JSON object per non-blank line."""
    with open(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _existing(path: Path, what: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{what}: {path} does not exist (the data sets are in bench/data/)")
    return path


# ------------------------------------------------------------------------------------------ MMLU
def read_mmlu_csv(path: Path) -> list[list[str]]:
    """hendrycks/test CSV rows: question, A, B, C, D, answer letter (no header)."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = [r for r in csv.reader(f) if r]
    for r in rows:
        if len(r) != 6 or r[5].strip() not in MMLU_LETTERS:
            raise ValueError(f"{path}: malformed MMLU row {r[:1]!r}")
    return rows


def mmlu_rows(subject: str, split: str, data_dir: Path | None = None) -> list[list[str]]:
    """Rows of one MMLU subject; `split` is `dev` (the 5 few-shot examples) or `test`."""
    if split not in ("dev", "test"):
        raise ValueError(f"unknown MMLU split {split!r} (dev or test)")
    path = (data_dir or DATA_DIR) / "mmlu" / split / f"{subject}_{split}.csv"
    return read_mmlu_csv(_existing(path, f"MMLU subject {subject!r}"))


# ------------------------------------------------------------------------------------------ GSM8K
def gsm8k_rows(split: str, data_dir: Path | None = None) -> list[dict[str, Any]]:
    """Rows `{"question", "answer"}` of `train_head200` (few-shot pool) or `test`, in file order."""
    if split not in GSM8K_SPLITS:
        raise ValueError(f"unknown GSM8K split {split!r} (one of {', '.join(GSM8K_SPLITS)})")
    path = (data_dir or DATA_DIR) / "gsm8k" / f"{split}.jsonl"
    return list(iter_jsonl(_existing(path, f"GSM8K split {split!r}")))


# ------------------------------------------------------------------------------------------ JSONSchemaBench
def load_subset(subset: str, data_dir: Path | None = None) -> list[dict[str, Any]]:
    """Rows `{"id", "schema"}` of one JSONSchemaBench subset, in file order."""
    path = (data_dir or DATA_DIR) / "jsonschemabench" / f"{subset}.jsonl"
    return list(iter_jsonl(_existing(path, f"JSONSchemaBench subset {subset!r}")))


def sample_rows(rows: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """`n` distinct rows drawn with `random.Random(seed)` (all rows, shuffled, when n >= len(rows))."""
    return random.Random(seed).sample(rows, min(max(n, 0), len(rows)))


def schema_text(schema: Any) -> str:
    """The JSON text sent as `json_schema` (and shown to the model)."""
    return json.dumps(schema)


def chat_prompt(tokenizer: Any, spec: str) -> str:
    """The chat prompt asking for one instance of the schema `spec` (JSON text)."""
    messages = [
        {"role": "system", "content": JSON_SYSTEM_PROMPT},
        {"role": "user", "content": f"Write one JSON instance of this JSON Schema:\n{spec}"},
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
