"""Tree of thought with `fork`: propose several first steps in parallel (the shared prompt is prefilled once,
so every branch starts from the server's prefix cache), let the model grade each with `select`, and finish the
best branch.

    python examples/tree_of_thought.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse

from lang import (
    RuntimeEndpoint,
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    select,
    system,
    user,
)


@function
def tree_of_thought(s, problem: str, branches: int, max_tokens: int):
    s += system("You solve problems step by step.")
    s += user(problem)
    s += assistant_begin() + "First step:"
    forks = s.fork(branches)
    forks += gen("step", max_tokens=max_tokens, stop="\n", temperature=0.9)  # all branches in parallel
    forks += assistant_end() + user("Is that first step correct and useful? Answer yes or no.")
    forks += assistant(select("verdict", choices=["yes", "no"]))

    def score(f) -> float:  # logprob of "yes" for the branch's verdict
        return f.get_meta_info("verdict")["normalized_logprobs"][0]

    best = max(forks, key=score)
    s += best["step"] + "\nNext steps:" + gen("rest", max_tokens=max_tokens)
    s += assistant_end()
    return [(f["step"], f["verdict"], score(f)) for f in forks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument(
        "--problem", default="A farmer has 17 sheep and buys 5 more, then sells 8. How many are left?"
    )
    parser.add_argument("--branches", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    backend = RuntimeEndpoint(args.url)
    state = tree_of_thought.run(
        problem=args.problem, branches=args.branches, max_tokens=args.max_tokens, backend=backend
    )
    for i, (step, verdict, score) in enumerate(state.ret_value):
        print(f"branch {i}: verdict={verdict} logprob(yes)={score:.3f} step={step.strip()!r}")
    print("\nbest solution:\n" + state.messages()[-1]["content"])


if __name__ == "__main__":
    main()
