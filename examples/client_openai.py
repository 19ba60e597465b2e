"""Use a radixlm server through the official `openai` client: chat, streaming, completions, JSON Schema
output, and reading how many prompt tokens came from the prefix cache.

    python examples/client_openai.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key)
    model = client.models.list().data[0].id
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ]

    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=args.max_tokens, temperature=0
    )
    print("chat:", chat.choices[0].message.content)

    print("stream: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=args.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        usage = chunk.usage or usage
    details = usage.prompt_tokens_details if usage else None
    print(
        f"\n  prompt tokens: {usage and usage.prompt_tokens}, "
        f"cached: {details.cached_tokens if details else None}"
    )

    completion = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=args.max_tokens, temperature=0
    )
    print("completion:", completion.choices[0].text)

    schema = {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["colors"],
    }
    structured = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=4 * args.max_tokens,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "colors", "schema": schema}},
    )
    content = structured.choices[0].message.content
    print("json_schema:", content)
    if structured.choices[0].finish_reason == "stop":
        print("  parsed:", json.loads(content))


if __name__ == "__main__":
    main()
