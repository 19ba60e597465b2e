"""A real tool loop with the official `openai` client: the model calls a calculator and a lookup tool
through OpenAI tool calling, Python runs them, the results go back as `tool` messages, until the model
answers in text (or the step limit). Prints each step's cached prompt tokens: the re-rendered history hits
the radix cache.

    python examples/agent_tools.py --url http://127.0.0.1:30000 --question "What is 12 times 7, plus 5?"

The default 135M model is weak at deciding when to stop; `--first-required` forces a call on the first step
(tool_choice "required", arguments guaranteed valid), later steps use "auto".
"""

from __future__ import annotations

import argparse
import ast
import json
import operator

import openai

FACTS = {
    "eiffel tower": "The Eiffel Tower is 330 metres tall.",
    "mount everest": "Mount Everest is 8849 metres tall.",
    "paris": "Paris is the capital of France.",
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "pattern": "^[0-9+*/(). -]{1,40}$"}},
                "required": ["expression"],
            },
            "strict": True,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a short fact about a topic.",
            "parameters": {
                "type": "object",
                "properties": {"topic": {"type": "string", "maxLength": 40}},
                "required": ["topic"],
            },
        },
    },
]


def calculator(expression: str) -> str:
    """Evaluate + - * / over numbers only (no names, no calls)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("only arithmetic is allowed")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value) if float(value).is_integer() else round(value, 6))


def lookup(topic: str) -> str:
    return FACTS.get(topic.strip().lower(), f"no entry for {topic!r}")


def run_tool(name: str, arguments: str) -> str:
    args = json.loads(arguments)
    if name == "calculator":
        return calculator(args["expression"])
    if name == "lookup":
        return lookup(args["topic"])
    return f"error: unknown tool {name!r}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--question", default="What is 12 times 7, plus 5?")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--first-required", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key)
    model = client.models.list().data[0].id
    messages: list[dict] = [
        {"role": "system", "content": "Use the tools to answer. Answer in one sentence when you know."},
        {"role": "user", "content": args.question},
    ]
    for step in range(args.max_steps):
        choice_mode = "required" if step == 0 and args.first_required else "auto"
        r = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            tool_choice=choice_mode,
            parallel_tool_calls=False,
            max_tokens=args.max_tokens,
            temperature=0,
        )
        msg = r.choices[0].message
        cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        print(f"step {step}: prompt {r.usage.prompt_tokens} tokens, {cached} cached")
        if not msg.tool_calls:
            print("answer:", msg.content)
            return
        messages.append(
            {
                "role": "assistant",
                "content": msg.content,
                "tool_calls": [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                    for c in msg.tool_calls
                ],
            }
        )
        for c in msg.tool_calls:
            result = run_tool(c.function.name, c.function.arguments)
            print(f"  {c.function.name}({c.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
    print("no final answer within", args.max_steps, "steps")


if __name__ == "__main__":
    main()
