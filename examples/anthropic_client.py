"""The same tool loop as `agent_tools.py` with the official `anthropic` client against radixlm's Messages
API: the model calls a calculator and a lookup tool (`tool_use` blocks), Python runs them, the results go
back as `tool_result` blocks, until the model answers in text (or the step limit). Prints each step's
`cache_read_input_tokens`: the re-rendered history hits the radix cache.

    pip install anthropic
    python examples/anthropic_client.py --url http://127.0.0.1:30000 --question "What is 12 times 7, plus 5?"

The default 135M model is weak at deciding when to stop; the first step forces a call (`tool_choice`
{"type": "any"}, arguments guaranteed valid), later steps use "auto".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import anthropic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_tools import TOOLS, run_tool  # noqa: E402  (the same tools, in OpenAI's shape)

# Anthropic's tool shape: name, description, input_schema
CLAUDE_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (t["function"] for t in TOOLS)
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--question", default="What is 12 times 7, plus 5?")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    client = anthropic.Anthropic(base_url=args.url.rstrip("/"), api_key=args.api_key)
    messages: list[dict] = [{"role": "user", "content": args.question}]
    for step in range(args.max_steps):
        m = client.messages.create(
            model="default",
            system="Use the tools to answer. Answer in one sentence when you know.",
            messages=messages,
            tools=CLAUDE_TOOLS,
            tool_choice={"type": "any" if step == 0 else "auto", "disable_parallel_tool_use": True},
            max_tokens=args.max_tokens,
            extra_body={"temperature": 0},  # recent clients no longer take it as an argument
        )
        u = m.usage
        print(
            f"step {step}: input {u.input_tokens + u.cache_read_input_tokens} tokens, "
            f"{u.cache_read_input_tokens} cached, stop_reason {m.stop_reason}"
        )
        uses = [b for b in m.content if b.type == "tool_use"]
        if not uses:
            print("answer:", "".join(b.text for b in m.content if b.type == "text"))
            return
        messages.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]}
        )
        results = []
        for b in uses:
            result = run_tool(b.name, json.dumps(b.input))
            print(f"  {b.name}({json.dumps(b.input)}) -> {result}")
            results.append({"type": "tool_result", "tool_use_id": b.id, "content": result})
        messages.append({"role": "user", "content": results})
    print("no final answer within", args.max_steps, "steps")


if __name__ == "__main__":
    main()
