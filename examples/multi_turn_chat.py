"""Multi-turn chat: each turn is a user message and an assistant reply, rendered with the model's own chat
template (so the prompt is exactly what `tokenizer.apply_chat_template` would produce).

    python examples/multi_turn_chat.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse

from lang import RuntimeEndpoint, assistant, function, gen, system, user

TURNS = [
    "Hi! Can you suggest a name for a pet goldfish?",
    "Why did you pick that name?",
    "Now suggest one for a cat.",
]


@function
def chat(s, turns: list[str], max_tokens: int):
    s += system("You are a friendly assistant. Keep every answer to one or two sentences.")
    for i, turn in enumerate(turns):
        s += user(turn)
        s += assistant(gen(f"reply_{i}", max_tokens=max_tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--turns", type=int, default=len(TURNS))
    args = parser.parse_args()

    state = chat.run(
        turns=TURNS[: args.turns],
        max_tokens=args.max_tokens,
        temperature=0,
        backend=RuntimeEndpoint(args.url),
    )
    for message in state.messages():
        print(f"[{message['role']}] {message['content']}")
    print(
        f"\n{len(state.text())} characters of prompt text; "
        f"last turn reused {state.get_meta_info(f'reply_{args.turns - 1}')['cached_tokens']} cached tokens"
    )


if __name__ == "__main__":
    main()
