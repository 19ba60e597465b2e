"""Tree of thought with nested `fork`: plans, then steps under each plan, each step judged with `select`.

Depth 2 and `--branches` b per level: b plans share the question prefix, b*b steps share their plan's prefix,
and b*b yes/no verdicts share their step's. radixlm prefills each shared prefix once (`fork` asks the backend
to cache it) and batches the branches of all programs together; the HF baseline recomputes every prefix in
every static batch. Outputs have a fixed length (greedy, `ignore_eos`, a distinct hint per branch) so both
sides generate the same number of tokens. Questions come from GSM8K test.

    python -m bench.tree_of_thought --quick
    python -m bench.tree_of_thought --num-questions 16 --branches 3 --max-tokens 32
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from bench.harness import common
from bench.harness.datasets import gsm8k_rows
from bench.harness.workload import Workload, add_workload_args, compare


def fan_out(forks: list, exprs: list) -> None:
    """Append a different expression to each fork, all in parallel (ForkGroup `+=` appends one to all)."""
    with ThreadPoolExecutor(max_workers=len(forks)) as pool:
        for fut in [pool.submit(f.__iadd__, e) for f, e in zip(forks, exprs)]:
            fut.result()


def make_program(branches: int, max_tokens: int):
    from lang import assistant_begin, function, gen, select, system, user

    def g(name: str):
        return gen(name, max_tokens=max_tokens, temperature=0, ignore_eos=True)

    @function
    def tree_of_thought(s, question: str):
        s += system("You solve math problems by exploring several approaches.")
        s += user(question)
        s += assistant_begin()
        plans = s.fork(branches)
        fan_out(plans, [f"Approach {i + 1}: " + g("plan") for i in range(branches)])

        def explore(plan) -> list:
            steps = plan.fork(branches)
            fan_out(steps, [f"\nStep {j + 1} of this approach: " + g("step") for j in range(branches)])
            steps += "\nIs this step correct? Answer:" + select("verdict", choices=[" yes", " no"])
            return [(st["step"], st["verdict"]) for st in steps]

        with ThreadPoolExecutor(max_workers=branches) as pool:
            tree = list(pool.map(explore, plans))
        return [(p["plan"], leaves) for p, leaves in zip(plans, tree)]

    return tree_of_thought


def main(argv: list[str] | None = None) -> dict:
    p = common.base_parser(__doc__.splitlines()[0])
    add_workload_args(p, default_sides="radixlm,hf", num_threads=8)
    p.add_argument("--num-questions", type=int, default=16)
    p.add_argument("--branches", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)
    if args.quick:
        args.num_questions, args.branches, args.max_tokens = 3, 2, 8
    test = gsm8k_rows("test")[: args.num_questions]
    items = [{"question": ex["question"]} for ex in test]
    warm = [{"question": "What is 2 + 3?"}]
    wl = Workload(
        "tree_of_thought",
        make_program(args.branches, args.max_tokens),
        items,
        warmup_items=warm,
        prediction=lambda s: s.ret_value,
        config={
            "num_questions": len(items),
            "branches": args.branches,
            "depth": 2,
            "max_tokens": args.max_tokens,
            "gens_per_program": args.branches + args.branches**2,
            "selects_per_program": args.branches**2,
            "dtype": args.dtype,
        },
    )
    return compare(wl, args)


if __name__ == "__main__":
    main()
