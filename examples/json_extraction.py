"""Structured extraction: the reply is constrained by a JSON Schema, so it always parses.

python examples/json_extraction.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json

from lang import RuntimeEndpoint, assistant, function, gen, system, user

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
TEXTS = [
    "Maria Lopez is 34 years old and lives in Madrid, where she works as an architect.",
    "At 71, retired teacher John Smith still walks his dog through Boston every morning.",
]


@function
def extract(s, text: str, max_tokens: int):
    s += system("Extract the person's name, age and city as JSON.")
    s += user(text)
    s += assistant(gen("record", max_tokens=max_tokens, json_schema=SCHEMA, temperature=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    states = extract.run_batch(
        [{"text": t, "max_tokens": args.max_tokens} for t in TEXTS],
        backend=RuntimeEndpoint(args.url),
        progress_bar=False,
    )
    for text, state in zip(TEXTS, states, strict=True):
        finish = state.get_meta_info("record")["finish_reason"]
        record = json.loads(state["record"]) if finish["type"] == "stop" else None
        print(f"{text}\n  -> {record if record is not None else state['record'] + ' (truncated)'}\n")


if __name__ == "__main__":
    main()
