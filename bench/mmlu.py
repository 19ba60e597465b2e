"""MMLU k-shot: `select` over " A"/" B"/" C"/" D" after a per-subject few-shot prefix, radixlm vs HF.

Every question of a subject starts with the same k dev examples, so radixlm computes that prefix once per
subject (radix cache) and each choice scores only its own token; the HF baseline recomputes prompt + choice
for every choice of every question. Both sides score a choice by the mean log-probability of its tokens after
the prompt (same tokenizer, same float32 weights): accuracy is identical, item by item, up to round-off ties.

`--format cloze` is the setting of SmolLM2's published MMLU figure (lighteval "MMLU cloze"): zero-shot,
"Question: ...\nAnswer:", and the choices are the answer texts themselves, so it measures knowledge rather
than the ability to name a letter (which a 135M model barely has). Scoring is still the mean token logprob;
lighteval normalises by characters, which can flip close calls.

    python -m bench.mmlu --quick
    python -m bench.mmlu --subjects all --num-questions 20 --num-shots 5
    python -m bench.mmlu --format cloze --num-questions 0 --sides radixlm
"""

from __future__ import annotations

import random
from pathlib import Path

from bench.harness import common
from bench.harness.datasets import MMLU_LETTERS as LETTERS
from bench.harness.datasets import MMLU_SUBJECTS as SUBJECTS
from bench.harness.datasets import mmlu_rows
from bench.harness.workload import Workload, add_workload_args, compare

CHOICES = (" A", " B", " C", " D")


def format_question(row: list[str], with_answer: bool) -> str:
    text = row[0].strip() + "".join(f"\n{LETTERS[i]}. {row[1 + i].strip()}" for i in range(4)) + "\nAnswer:"
    return text + f" {row[5].strip()}\n\n" if with_answer else text


def few_shot_prefix(subject: str, dev_rows: list[list[str]], k: int) -> str:
    head = (
        f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    )
    return head + "".join(format_question(r, True) for r in dev_rows[:k])


def cloze_item(row: list[str]) -> tuple[dict, str]:
    """Zero-shot cloze: the choices are the four answer texts; the label is the correct one."""
    choices = [" " + row[1 + i].strip() for i in range(4)]
    return (
        {"prefix": "", "question": f"Question: {row[0].strip()}\nAnswer:", "choices": choices},
        choices[LETTERS.index(row[5].strip())].strip(),
    )


def build_items(
    data_dir: Path | None,
    subjects: list[str],
    num_questions: int | None,
    k: int,
    seed: int,
    fmt: str = "letter",
) -> tuple[list[dict], list[str]]:
    """(program kwargs, labels): the first `num_questions` test rows of each subject (all if None),
    interleaved across subjects in a seeded order so that no side sees them grouped. Labels are answer
    letters (`letter`) or answer texts (`cloze`). `data_dir` None: bench/data."""
    if fmt not in ("letter", "cloze"):
        raise ValueError(f"unknown MMLU format {fmt!r} (letter or cloze)")
    items, labels = [], []
    for subject in subjects:
        dev = mmlu_rows(subject, "dev", data_dir)
        test = mmlu_rows(subject, "test", data_dir)
        prefix = few_shot_prefix(subject, dev, k)
        for row in test[:num_questions]:
            if fmt == "cloze":
                item, label = cloze_item(row)
            else:
                item = {"prefix": prefix, "question": format_question(row, False), "choices": list(CHOICES)}
                label = row[5].strip()
            items.append(item)
            labels.append(label)
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in order], [labels[i] for i in order]


def make_program():
    from lang import function, select

    @function
    def mmlu_question(s, prefix: str, question: str, choices: list[str]):
        s += prefix + question
        s += select("answer", choices=choices)

    return mmlu_question


def score(label: str, state) -> float:
    return float(state["answer"].strip() == label)


def main(argv: list[str] | None = None) -> dict:
    p = common.base_parser(__doc__.splitlines()[0])
    add_workload_args(p, default_sides="radixlm,hf", num_threads=32)
    p.add_argument("--subjects", default="all", help=f"comma-separated or 'all' ({', '.join(SUBJECTS)})")
    p.add_argument("--num-questions", type=int, default=20, help="test questions per subject (0: all)")
    p.add_argument("--num-shots", type=int, default=5, help="letter format only (cloze is zero-shot)")
    p.add_argument(
        "--format",
        choices=("letter", "cloze"),
        default="letter",
        help="letter: k-shot, choices ' A'..' D'; cloze: zero-shot, choices are the answer texts",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.subjects, args.num_questions = "global_facts,machine_learning", 6
    subjects = list(SUBJECTS) if args.subjects == "all" else common.csv_list(args.subjects)
    items, labels = build_items(
        None, subjects, args.num_questions or None, args.num_shots, args.seed, args.format
    )
    # Warm-up on a different subject's prefix style: two dev questions of the first subject, cache flushed
    # after.
    dev = mmlu_rows(subjects[0], "dev")
    warm = [
        {
            "prefix": few_shot_prefix(subjects[0], dev, 2),
            "question": format_question(r, False),
            "choices": list(CHOICES),
        }
        for r in dev[3:5]
    ]
    wl = Workload(
        "mmlu",
        make_program(),
        items,
        labels=labels,
        score=score,
        prediction=lambda s: s["answer"],
        warmup_items=warm,
        config={
            "subjects": subjects,
            "num_questions": args.num_questions,
            "format": args.format,
            "num_shots": 0 if args.format == "cloze" else args.num_shots,
            "seed": args.seed,
            "choices": list(CHOICES) if args.format == "letter" else "answer texts",
            "dtype": args.dtype,
        },
    )
    if args.format == "cloze" and args.name is None:
        args.name = "mmlu_cloze"
    return compare(wl, args)


if __name__ == "__main__":
    main()
