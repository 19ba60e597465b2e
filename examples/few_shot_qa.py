"""Few-shot question answering: a plain-text prompt with worked examples, answered in a batch.

python examples/few_shot_qa.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse

from lang import RuntimeEndpoint, function, gen, set_default_backend

EXAMPLES = [
    ("What is the capital of France?", "Paris"),
    ("How many legs does a spider have?", "Eight"),
    ("What color is the sky on a clear day?", "Blue"),
]
QUESTIONS = [
    "What is the capital of Japan?",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Which animal says moo?",
]


@function
def few_shot_qa(s, question: str, max_tokens: int):
    s += "Answer each question with a single word or number.\n\n"
    for q, a in EXAMPLES:
        s += f"Question: {q}\nAnswer: {a}\n\n"
    s += f"Question: {question}\nAnswer:" + gen("answer", max_tokens=max_tokens, stop="\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-questions", type=int, default=len(QUESTIONS))
    args = parser.parse_args()

    set_default_backend(RuntimeEndpoint(args.url))
    questions = QUESTIONS[: args.num_questions]
    states = few_shot_qa.run_batch(
        [{"question": q, "max_tokens": args.max_tokens} for q in questions], temperature=0
    )
    for q, state in zip(questions, states, strict=True):
        print(f"Q: {q}\nA: {state['answer'].strip()}\n")


if __name__ == "__main__":
    main()
