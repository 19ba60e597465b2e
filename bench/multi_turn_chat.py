"""Multi-turn chat: 4 synthetic turns per conversation, short and long outputs; radix cache on vs off vs HF.

Every turn's prompt is the whole conversation so far, so with the radix cache only the new user message is
prefilled; with `--disable-radix-cache` (side `radixlm-noradix`) and on the HF baseline the history is
recomputed each turn. User messages are synthetic word sequences of about `--turn-tokens` tokens (seeded);
outputs have a fixed length (`ignore_eos`) so every side generates the same number of tokens.

Bound: with T equal turns of m prompt tokens and no shared system prompt, the cache saves at most
(1 + 2 + ... + T) m / (T m) = (T + 1) / 2 of the prefill, i.e. 2.5x at T = 4, and decode is the same on both
sides; a system prompt shared by all conversations (`--system-tokens`) raises the bound, as in a deployed chat
service.

    python -m bench.multi_turn_chat --quick
    python -m bench.multi_turn_chat --num-convs 16 --turn-tokens 256 --short-tokens 8 --long-tokens 128
"""

from __future__ import annotations

import random

from bench.harness import common
from bench.harness.workload import Workload, add_workload_args, compare

NUM_TURNS = 4
_WORDS = (
    "the river model cache token prefix server batch memory kernel request answer question "
    "light garden market music window forest planet number story simple quiet rapid golden "
    "paper stone winter summer morning evening travel letter engine signal bridge"
).split()


def synthetic_message(rng: random.Random, approx_tokens: int) -> str:
    """About `approx_tokens` tokens of lowercase words (these common words are mostly one token each)."""
    return " ".join(rng.choice(_WORDS) for _ in range(approx_tokens)) + "?"


def conversations(num: int, turn_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"turns": [synthetic_message(rng, turn_tokens) for _ in range(NUM_TURNS)]} for _ in range(num)]


def system_prompt(tokens: int, seed: int) -> str:
    """The system prompt every conversation shares; `tokens` > 0 appends that many synthetic words."""
    head = "You are a helpful assistant. Reply briefly."
    return head if tokens <= 0 else head + " Background: " + synthetic_message(random.Random(seed), tokens)


def make_program(max_tokens: int, system_text: str):
    from lang import assistant, function, gen, system, user

    @function
    def chat(s, turns: list[str]):
        s += system(system_text)
        for i, msg in enumerate(turns):
            s += user(msg)
            s += assistant(gen(f"reply{i}", max_tokens=max_tokens, temperature=0, ignore_eos=True))

    return chat


def main(argv: list[str] | None = None) -> dict:
    p = common.base_parser(__doc__.splitlines()[0])
    add_workload_args(p, default_sides="radixlm,radixlm-noradix,hf", num_threads=16)
    p.add_argument("--num-convs", type=int, default=16)
    p.add_argument("--turn-tokens", type=int, default=256, help="approximate tokens of each user message")
    p.add_argument("--short-tokens", type=int, default=8, help="output tokens per turn, short setting")
    p.add_argument("--long-tokens", type=int, default=128, help="output tokens per turn, long setting")
    p.add_argument("--settings", default="short,long", help="which output settings to run")
    p.add_argument(
        "--system-tokens",
        type=int,
        default=0,
        help="approximate tokens of a system prompt shared by every conversation (0: one sentence)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.num_convs, args.turn_tokens, args.short_tokens, args.long_tokens = 4, 128, 4, 16
    convs = conversations(args.num_convs, args.turn_tokens, args.seed)
    warm = conversations(2, 16, args.seed + 1)
    base_name = args.name or "multi_turn_chat"
    out = {}
    for setting in common.csv_list(args.settings):
        tokens = {"short": args.short_tokens, "long": args.long_tokens}[setting]
        wl = Workload(
            f"multi_turn_chat_{setting}",
            make_program(tokens, system_prompt(args.system_tokens, args.seed)),
            convs,
            warmup_items=warm,
            prediction=lambda s: tuple(s[f"reply{i}"] for i in range(NUM_TURNS)),
            config={
                "setting": setting,
                "num_convs": len(convs),
                "turns": NUM_TURNS,
                "turn_tokens": args.turn_tokens,
                "output_tokens_per_turn": tokens,
                "system_tokens": args.system_tokens,
                "dtype": args.dtype,
            },
        )
        args.name = f"{base_name}_{setting}"
        out[setting] = compare(
            wl, args, baseline="radixlm-noradix" if "radixlm-noradix" in args.sides else None
        )
    return out


if __name__ == "__main__":
    main()
