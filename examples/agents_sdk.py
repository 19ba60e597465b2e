"""A real agent run by the OpenAI Agents SDK (`openai-agents`) against radixlm through the Responses API:
two function tools (calculator, lookup), the SDK's own loop (`Runner`), nothing radixlm-specific but the
base URL. With `--chain` the SDK continues each turn with `previous_response_id`, so radixlm re-renders the
stored conversation and the radix cache serves its prefix.

    pip install openai-agents
    python examples/agents_sdk.py --url http://127.0.0.1:30000 --question "What is 12 times 7, plus 5?"

The default 135M model is weak at deciding when to call; the first turn forces a call (`tool_choice`
"required", arguments guaranteed valid by the grammar), after which the SDK resets it to "auto".
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_tools import calculator as _calculator  # noqa: E402  (the same safe evaluator and facts)
from agent_tools import lookup as _lookup  # noqa: E402


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses."""
    return _calculator(expression)


@function_tool
def lookup(topic: str) -> str:
    """Look up a short fact about a topic."""
    return _lookup(topic)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--question", default="What is 12 times 7, plus 5?")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chain", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    set_tracing_disabled(True)  # traces go to OpenAI's servers; a local server needs none
    client = AsyncOpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key)
    model_name = (await client.models.list()).data[0].id
    agent = Agent(
        name="calculator agent",
        instructions="Use the tools to answer. Answer in one sentence when you know.",
        tools=[calculator, lookup],
        model=OpenAIResponsesModel(model=model_name, openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=args.max_tokens
        ),
    )
    result = await Runner.run(
        agent, args.question, max_turns=args.max_turns, auto_previous_response_id=args.chain
    )
    for item in result.new_items:
        print(f"{item.type}: {getattr(item, 'raw_item', item)!s:.160}")
    for k, response in enumerate(result.raw_responses):
        usage = response.usage
        print(
            f"turn {k}: input {usage.input_tokens} tokens, {usage.input_tokens_details.cached_tokens} cached"
        )
    print("answer:", result.final_output)


if __name__ == "__main__":
    asyncio.run(main())
