"""Forced tool calls over real-world function schemas through the real server and model (issue 16).

For the first N parameter schemas of jsonschemabench's Glaiveai2K subset (48 in `make test`;
RADIXLM_TOOL_SCHEMAS=200 for the issue's full run, which outlasts the suite's 600 s test limit on 2 loaded
cores), one `tool_choice: "required"` request each, sent concurrently with the official client: every reply
must end in exactly one call whose arguments validate with `jsonschema`. Slow on a CPU (one grammar compile
per schema over the 49k vocabulary, then decoding); tests/unit/test_tool_call_schemas.py checks the same
guarantee without the model in seconds.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

DATA = Path(__file__).resolve().parents[2] / "bench/data/jsonschemabench/Glaiveai2K.jsonl"
NUM = int(os.environ.get("RADIXLM_TOOL_SCHEMAS", "48"))
# Same exclusions as the unit test: a known grammar gap and two schemas answered with a 400.
SKIP = {"calculate_area_27950976", "calculate_area_2f92f3ea", "calculate_area_08e029cf"}


@pytest.mark.slow
def test_required_calls_validate_for_real_schemas(server_url):
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    rows = [r for r in rows if r["id"] not in SKIP][:NUM]
    client = openai.OpenAI(base_url=server_url + "/v1", api_key="unused", timeout=1800, max_retries=0)

    def call(row, max_tokens=256):
        tool = {"type": "function", "function": {"name": row["id"][:64], "parameters": row["schema"]}}
        r = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Call the tool with realistic arguments."}],
            tools=[tool],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=max_tokens,
            temperature=0,
            frequency_penalty=0.5,  # the 135M model loops inside long strings without it
        )
        return row, r.choices[0]

    start = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(call, rows))
        # The grammar bounds every call (strings, arrays, depth), but some need more than 256 tokens: those
        # cut by the token limit are asked again with room to finish, and must then validate too.
        cut = [i for i, (_, choice) in enumerate(results) if choice.finish_reason == "length"]
        for i, redo in zip(cut, pool.map(lambda i: call(rows[i], 1024), cut)):
            results[i] = redo
    elapsed = time.perf_counter() - start
    bad = []
    for row, choice in results:
        calls = choice.message.tool_calls or []
        try:
            assert choice.finish_reason == "tool_calls" and len(calls) == 1, choice.finish_reason
            assert calls[0].function.name == row["id"][:64]
            jsonschema.validate(json.loads(calls[0].function.arguments), row["schema"])
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            bad.append((row["id"], str(e).splitlines()[0][:120]))
    print(f"{len(rows)} schemas, {len(cut)} retried with 1024 tokens, {len(bad)} invalid, {elapsed:.0f} s")
    assert not bad, bad
    client.close()
