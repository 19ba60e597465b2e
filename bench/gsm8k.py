"""GSM8K few-shot: greedy `gen` with stop strings after a shared few-shot prefix, accuracy by final number.

The k worked examples (from the train head, calculator annotations `<<...>>` removed) are the same for every
question, so radixlm prefills them once; the HF baseline recomputes them in every padded batch. The answer is
the last number in the generated text, compared with the number after `####` in the reference.

    python -m bench.gsm8k --quick
    python -m bench.gsm8k --num-questions 64 --num-shots 5
"""

from __future__ import annotations

import re

from bench.harness import common
from bench.harness.datasets import gsm8k_rows
from bench.harness.workload import Workload, add_workload_args, compare

STOP = ["Question:", "\n\n"]
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_CALC = re.compile(r"<<[^>]*>>")


def parse_number(text: str) -> float | None:
    """The last number in `text` ("1,234.50" -> 1234.5); None if there is none."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


def reference_answer(answer: str) -> float:
    """The number after `####` in a GSM8K reference answer."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer without '####': {answer[-80:]!r}")
    value = parse_number(answer.split("####")[-1])
    if value is None:
        raise ValueError(f"no number after '####' in {answer[-80:]!r}")
    return value


def clean_solution(answer: str) -> str:
    """Reference solution as few-shot text: calculator annotations dropped, final line 'The answer is N.'"""
    body, _, final = answer.partition("####")
    return _CALC.sub("", body).strip() + f"\nThe answer is {final.strip()}."


def few_shot_prefix(train: list[dict], k: int) -> str:
    return "".join(
        f"Question: {ex['question']}\nAnswer: {clean_solution(ex['answer'])}\n\n" for ex in train[:k]
    )


def make_program(max_tokens: int):
    from lang import function, gen

    @function
    def gsm8k_question(s, prefix: str, question: str):
        s += prefix + f"Question: {question}\nAnswer:"
        s += gen("answer", max_tokens=max_tokens, stop=STOP, temperature=0)

    return gsm8k_question


def score(label: float, state) -> float:
    got = parse_number(state["answer"])
    return float(got is not None and abs(got - label) < 1e-6)


def main(argv: list[str] | None = None) -> dict:
    p = common.base_parser(__doc__.splitlines()[0])
    add_workload_args(p, default_sides="radixlm,hf", num_threads=32)
    p.add_argument("--num-questions", type=int, default=64)
    p.add_argument("--num-shots", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=192)
    args = p.parse_args(argv)
    if args.quick:
        args.num_questions, args.max_tokens = 8, 48
    train = gsm8k_rows("train_head200")
    test = gsm8k_rows("test")[: args.num_questions]
    prefix = few_shot_prefix(train, args.num_shots)
    items = [{"prefix": prefix, "question": ex["question"]} for ex in test]
    labels = [reference_answer(ex["answer"]) for ex in test]
    warm = [{"prefix": few_shot_prefix(train[10:], 1), "question": ex["question"]} for ex in train[100:102]]
    wl = Workload(
        "gsm8k",
        make_program(args.max_tokens),
        items,
        labels=labels,
        score=score,
        prediction=lambda s: s["answer"],
        warmup_items=warm,
        config={
            "num_questions": len(items),
            "num_shots": args.num_shots,
            "max_tokens": args.max_tokens,
            "stop": STOP,
            "dtype": args.dtype,
        },
    )
    return compare(wl, args)


if __name__ == "__main__":
    main()
