"""What serializing a logprob-heavy HTTP response costs: stdlib json (as radixlm did before) vs orjson (now).

Micro-benchmark: a realistic native /generate response and an OpenAI chat completion, each with 100 output
tokens x 20 top logprobs (token texts include non-ASCII), are serialized by
- `fastapi-default`: FastAPI's path for a handler returning a dict (`jsonable_encoder`, then Starlette's
  `JSONResponse.render`: json.dumps(ensure_ascii=False, allow_nan=False, compact)), what radixlm did before;
- `stdlib-json`: the json.dumps render alone;
- `orjson`: `runtime.entrypoints.http_common.dumps`, what the handlers return now (a ready Response, so
  FastAPI skips jsonable_encoder);
and one SSE chunk (the same native dict) by the old `sse()` (json.dumps) vs the new one (orjson).
Every path's output is parsed back and compared with the input, so a faster but wrong encoder fails here.

With `--url`, also times `--requests` real /generate calls with as many logprob entries (text included) end to
end against a running server (`--e2e prompt`: a 100-token prompt scored, one prefill; `--e2e decode`: 100
generated tokens): run it once against a server of each version.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.harness import common

TOKENS = ["the", " café", " naïve", "日本", " 🙂", "\n", " résumé", ' "q"', "\\", " Zürich", " x", "-"]


def native_response(num_tokens: int, top_n: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)

    def entry() -> list[Any]:
        return [-rng.random() * 8, rng.randrange(49152), rng.choice(TOKENS)]

    out = [entry() for _ in range(num_tokens)]
    return {
        "text": "".join(e[2] for e in out),
        "output_ids": [e[1] for e in out],
        "meta_info": {
            "id": "5f1c0b8e2d6a4c7e9b3a1f0d2c4e6a8b",
            "prompt_tokens": 12,
            "completion_tokens": num_tokens,
            "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": num_tokens},
            "e2e_latency": 1.2345678,
            "input_token_logprobs": [],
            "output_token_logprobs": out,
            "input_top_logprobs": [],
            "output_top_logprobs": [[entry() for _ in range(top_n)] for _ in range(num_tokens)],
        },
    }


def chat_response(native: dict[str, Any]) -> dict[str, Any]:
    meta = native["meta_info"]

    def item(e: list[Any]) -> dict[str, Any]:
        return {"token": e[2], "logprob": e[0], "bytes": list(e[2].encode())}

    content = [
        {**item(e), "top_logprobs": [item(t) for t in top]}
        for e, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"])
    ]
    return {
        "id": "chatcmpl-5f1c0b8e2d6a4c7e",
        "object": "chat.completion",
        "created": 1764726000,
        "model": "default",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": native["text"]},
                "logprobs": {"content": content},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": len(content), "total_tokens": 12 + len(content)},
    }


def stdlib_render(content: Any) -> bytes:
    """Starlette JSONResponse.render, as radixlm's responses went out before orjson."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode()


def fastapi_default(content: Any) -> bytes:
    from fastapi.encoders import jsonable_encoder

    return stdlib_render(jsonable_encoder(content))


def old_sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def best_of(fn: Callable[[Any], bytes], arg: Any, repeats: int, number: int) -> float:
    """Fastest mean seconds per call over `repeats` rounds of `number` calls (least disturbed by load)."""
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn(arg)
        rounds.append((time.perf_counter() - t0) / number)
    return min(rounds)


def micro(repeats: int, number: int, num_tokens: int, top_n: int) -> list[dict[str, Any]]:
    from runtime.entrypoints.http_common import dumps, sse

    native = native_response(num_tokens, top_n)
    docs = {"native /generate": native, "chat.completion": chat_response(native)}
    rows = []
    for doc_name, doc in docs.items():
        paths = {"fastapi-default": fastapi_default, "stdlib-json": stdlib_render, "orjson": dumps}
        for path, fn in paths.items():
            body = fn(doc)
            assert json.loads(body) == doc, f"{path} changed the {doc_name} document"
            rows.append(
                {
                    "document": doc_name,
                    "serializer": path,
                    "bytes": len(body),
                    "ms": best_of(fn, doc, repeats, number) * 1e3,
                }
            )
    for path, fn in {"stdlib-json": old_sse, "orjson": sse}.items():
        chunk = fn(native)
        assert chunk.startswith(b"data: ") and json.loads(chunk[6:]) == native, path
        rows.append(
            {
                "document": "SSE chunk",
                "serializer": path,
                "bytes": len(chunk),
                "ms": best_of(fn, native, repeats, number) * 1e3,
            }
        )
    return rows


def end_to_end(url: str, kind: str, requests_n: int, num_tokens: int, top_n: int) -> dict[str, Any]:
    """Time real /generate calls whose response holds `num_tokens` x `top_n` logprob entries.

    kind "decode": `num_tokens` generated tokens (the model's decode time dominates on a CPU);
    kind "prompt": a `num_tokens`-token prompt scored from position 0 plus one new token (one prefill, so
    the response handling is a visible share of the latency).
    """
    import requests

    body: dict[str, Any] = {
        "return_logprob": True,
        "top_logprobs_num": top_n,
        "return_text_in_logprobs": True,
    }
    if kind == "decode":
        body["text"] = "Write a long story about a lighthouse keeper."
        body["sampling_params"] = {"max_new_tokens": num_tokens, "temperature": 0, "ignore_eos": True}
        key, want = "output_top_logprobs", num_tokens
    else:
        body["input_ids"] = [1000 + 7 * i for i in range(num_tokens)]
        body["sampling_params"] = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
        body["logprob_start_len"] = 0
        key, want = "input_top_logprobs", num_tokens
    requests.post(f"{url}/generate", json=body, timeout=300).raise_for_status()  # warm-up
    seconds, sizes = [], []
    for _ in range(requests_n):
        t0 = time.perf_counter()
        r = requests.post(f"{url}/generate", json=body, timeout=300)
        seconds.append(time.perf_counter() - t0)
        r.raise_for_status()
        out = r.json()
        assert len(out["meta_info"][key]) == want, len(out["meta_info"][key])
        sizes.append(len(r.content))
    return {
        "url": url,
        "kind": kind,
        "requests": requests_n,
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "seconds": seconds,
        "response_bytes": sizes[0],
    }


def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=100, help="output tokens in the response")
    p.add_argument("--top-logprobs", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5, help="timing rounds (the fastest is reported)")
    p.add_argument("--number", type=int, default=10, help="calls per round")
    p.add_argument("--url", default=None, help="also time real /generate requests against this server")
    p.add_argument("--requests", type=int, default=5, help="end-to-end requests with --url")
    p.add_argument("--e2e", choices=["prompt", "decode"], default="prompt", help="see end_to_end()")
    p.add_argument("--no-micro", action="store_true", help="only the end-to-end requests (needs --url)")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.number, args.requests = 2, 5, 2
    name = args.name or "json_serialize"
    common.setup_env()
    env = common.environment()
    if args.no_micro and not args.url:
        p.error("--no-micro needs --url")
    rows = [] if args.no_micro else micro(args.repeats, args.number, args.tokens, args.top_logprobs)
    if rows:
        common.print_table(
            rows,
            ["document", "serializer", "bytes", "ms"],
            title=f"{args.tokens} tokens x {args.top_logprobs} top logprobs, best of {args.repeats}",
        )
    results: dict[str, Any] = {"micro": rows}
    if args.url:
        e2e = end_to_end(args.url, args.e2e, args.requests, args.tokens, args.top_logprobs)
        print(
            f"end to end ({args.e2e}): {e2e['requests']} requests, median {e2e['median_s'] * 1e3:.1f} ms, "
            f"min {e2e['min_s'] * 1e3:.1f} ms, {e2e['response_bytes']} bytes",
            flush=True,
        )
        results["end_to_end"] = e2e
    keys = ("tokens", "top_logprobs", "repeats", "number", "url", "e2e", "requests")
    config = {k: getattr(args, k) for k in keys}
    config["command"] = common.command_line()
    common.write_results(name, config, results, env=env, results_dir=args.results_dir)
    if not rows:
        return
    docs = sorted({r["document"] for r in rows}, key=[r["document"] for r in rows].index)
    series = {
        s: [next((r["ms"] for r in rows if r["document"] == d and r["serializer"] == s), None) for d in docs]
        for s in ("fastapi-default", "stdlib-json", "orjson")
    }
    common.bar_chart(
        common.plot_path(name, args.results_dir),
        docs,
        series,
        "ms per response",
        f"{args.tokens} tokens x {args.top_logprobs} top logprobs",
    )


if __name__ == "__main__":
    main()
