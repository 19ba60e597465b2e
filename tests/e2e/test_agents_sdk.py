"""The OpenAI Agents SDK (`openai-agents`) runs its own loop against radixlm's Responses API (issue 26).

The first turn forces a call (`tool_choice` "required": the grammar makes the arguments valid); with
`stop_on_first_tool` the run ends with that tool's output, so the test is deterministic on a 135M model.
"""

from __future__ import annotations

import asyncio

import pytest

agents = pytest.importorskip("agents")
from openai import AsyncOpenAI  # noqa: E402

CALLS: list[str] = []


@agents.function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 12 * 7."""
    CALLS.append(expression)
    return "84"


def make_agent(server_url: str, behavior: str = "stop_on_first_tool"):
    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=server_url + "/v1", api_key="unused", timeout=300, max_retries=0)
    model = agents.OpenAIResponsesModel(model="default", openai_client=client)
    settings = agents.ModelSettings(
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=40
    )
    return agents.Agent(
        name="calc",
        instructions="Use the calculator.",
        tools=[calculator],
        model=model,
        model_settings=settings,
        tool_use_behavior=behavior,
    )


def test_runner_calls_the_tool(server_url):
    CALLS.clear()
    result = asyncio.run(agents.Runner.run(make_agent(server_url), "What is 12 times 7?", max_turns=2))
    assert len(CALLS) == 1 and result.final_output == "84"
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]


def test_streamed_runner_calls_the_tool(server_url):
    CALLS.clear()

    async def run():
        streamed = agents.Runner.run_streamed(make_agent(server_url), "What is 12 times 7?", max_turns=2)
        kinds = [e.type async for e in streamed.stream_events()]
        return streamed, kinds

    streamed, kinds = asyncio.run(run())
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert len(CALLS) == 1 and streamed.final_output == "84"


def test_chained_run_continues_from_the_cached_prefix(server_url):
    """`auto_previous_response_id`: the SDK's second turn sends only the tool output with the first
    response's id; radixlm re-renders the stored conversation, so it is a prefix-cache hit."""
    CALLS.clear()
    agent = make_agent(server_url, "run_llm_again")
    try:
        result = asyncio.run(
            agents.Runner.run(agent, "What is 12 times 7?", max_turns=2, auto_previous_response_id=True)
        )
        responses = result.raw_responses
    except agents.exceptions.MaxTurnsExceeded as e:  # the model may keep calling: two turns ran anyway
        responses = e.run_data.raw_responses
    assert len(responses) == 2 and CALLS
    first, second = responses[0].usage, responses[1].usage
    assert second.input_tokens_details.cached_tokens >= 0.9 * (first.input_tokens + first.output_tokens)
