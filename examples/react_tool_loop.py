"""ReAct-style tool loop: the model picks a tool with `select`, writes its argument with `gen` (a regex keeps
calculator input to arithmetic), Python runs the tool, and the observation goes back into the prompt.

    python examples/react_tool_loop.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import ast
import operator

from lang import RuntimeEndpoint, function, gen, select

FACTS = {
    "eiffel tower": "The Eiffel Tower is 330 metres tall.",
    "mount everest": "Mount Everest is 8849 metres tall.",
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

PROMPT = (
    "Solve the question with tools. "
    "Tools: calculator[arithmetic expression], lookup[topic], finish[answer].\n"
    """
Question: What is 12 times 7, plus 5?
Thought: I should compute 12 * 7 + 5.
Action: calculator[12 * 7 + 5]
Observation: 89
Thought: I know the answer.
Action: finish[89]

"""
)


def calculator(expression: str) -> str:
    """Evaluate + - * / over numbers only (no names, no calls)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("unsupported expression")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value) if float(value).is_integer() else round(value, 6))


def lookup(topic: str) -> str:
    return FACTS.get(topic.strip().lower(), f"no entry for {topic.strip()!r}")


@function
def react(s, question: str, max_steps: int, max_tokens: int):
    s += PROMPT + f"Question: {question}\n"
    for step in range(max_steps):
        s += "Thought:" + gen(f"thought_{step}", max_tokens=max_tokens, stop="\n") + "\n"
        s += "Action: " + select(f"action_{step}", choices=["calculator", "lookup", "finish"]) + "["
        action = s[f"action_{step}"]
        if action == "calculator":
            s += gen(f"arg_{step}", max_tokens=max_tokens, regex=r"[0-9+*/(). -]{1,40}") + "]\n"
            s += f"Observation: {calculator(s[f'arg_{step}'])}\n"
        elif action == "lookup":
            s += gen(f"arg_{step}", max_tokens=max_tokens, stop=["]", "\n"]) + "]\n"
            s += f"Observation: {lookup(s[f'arg_{step}'])}\n"
        else:
            s += gen("answer", max_tokens=max_tokens, stop=["]", "\n"]) + "]\n"
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--question", default="What is 23 times 4, minus 10?")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    state = react.run(
        question=args.question,
        max_steps=args.max_steps,
        max_tokens=args.max_tokens,
        temperature=0,
        backend=RuntimeEndpoint(args.url),
    )
    print(state.text()[len(PROMPT) :])
    print("final answer:", state["answer"] if "answer" in state else "(no finish within the step limit)")


if __name__ == "__main__":
    main()
