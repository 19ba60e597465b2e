"""Burst bench: rounds of N concurrent streaming chat requests, and what each round leaves behind in memory.

Each round opens N streaming `/v1/chat/completions` requests at once (one `httpx.AsyncClient` per round, as
a burst of agents would), waits for all of them, waits for the server to go idle, and then records the
RSS of every server process, the scheduler's own memory report (`/get_server_info`'s `memory`) and the
round's output tokens per second. Prompts are either `repeated` (50 short chat prompts cycled: the radix
cache and the shared speculative index see the same text again) or `distinct` (every request new).

    python -m bench.burst                                   # 10 rounds of 1,000, repeated and distinct,
                                                            # speculation on (default) and off
    python -m bench.burst --rounds 3 --concurrency 300 --prompts distinct --speculative on
    python -m bench.burst --url http://127.0.0.1:30000 --server-pid 1234 --rounds 2

The targets (issue: memory under bursts): scheduler RSS growth <= 50 MB per 1,000 requests after the first
round, and no round's output tok/s below half of the first round's. Writes bench/results/burst.json (one
entry per configuration) and burst.png; exit status 1 when a target is missed or a request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.harness.common import environment
from bench.soak import process_roles, process_tree, rss_mb, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GROWTH_MB_PER_1K = 50.0  # target: scheduler RSS growth per 1,000 requests after the first round
MIN_TPUT_RATIO = 0.5  # target: every round's tok/s at least this share of the first's
TOPICS = ("the sea", "a compiler", "prime numbers", "rain", "a library", "the moon", "bread", "chess",
          "a river", "trains")  # fmt: skip
ASKS = ("Write one sentence about", "Give a short fact about", "Name two things related to",
        "Describe in a few words", "Say something kind about")  # fmt: skip


def prompts(kind: str, round_no: int, n: int, seed: int) -> list[str]:
    """`repeated`: 50 fixed prompts cycled; `distinct`: every request of every round a new text."""
    if kind == "repeated":
        fixed = [f"{a} {t}." for a in ASKS for t in TOPICS]
        return [fixed[i % len(fixed)] for i in range(n)]
    rng = random.Random(seed * 1_000_003 + round_no)
    return [
        f"Request {round_no}-{i} ({rng.randrange(10**9)}): {rng.choice(ASKS)} {rng.choice(TOPICS)}."
        for i in range(n)
    ]


async def one_request(
    client: httpx.AsyncClient, url: str, text: str, args, leave_after: int | None = None
) -> tuple[bool, int, str]:
    """One streaming chat request: (ok, output tokens from the final usage chunk, error). With
    `leave_after` the client disconnects after that many chunks (the server aborts the request)."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = chunks = 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                return False, 0, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    return True, 0, ""  # gone mid-stream: the server aborts it
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return True, tokens, ""
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return False, 0, f"{type(e).__name__}: {e}"


async def one_round(
    url: str, texts: list[str], args, abort_share: float = 0.0, headers: dict[str, str] | None = None
) -> dict:
    """All of `texts` at once; every 1/abort_share-th client leaves after its second chunk. `headers`: sent
    with every request (an API key)."""
    limits = httpx.Limits(max_connections=len(texts), max_keepalive_connections=len(texts))
    every = round(1 / abort_share) if abort_share > 0 else 0
    leave = [2 if every and i % every == 0 else None for i in range(len(texts))]
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits, headers=headers) as client:
        jobs = [one_request(client, url, t, args, after) for t, after in zip(texts, leave)]
        results = await asyncio.gather(*jobs)
    wall = time.monotonic() - t0
    tokens = sum(n for _, n, _ in results)
    errors = [e for ok, _, e in results if not ok]
    return {
        "requests": len(texts),
        "left_mid_stream": sum(after is not None for after in leave),
        "failed": len(errors),
        "errors": sorted(set(errors))[:5],
        "wall_s": round(wall, 2),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 1) if wall > 0 else 0.0,
    }


def wait_idle(url: str, timeout: float = 300) -> dict:
    """The scheduler's info once nothing is running or queued (it checks its KV accounting then)."""
    deadline = time.monotonic() + timeout
    info: dict = {}
    while time.monotonic() < deadline:
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        if not info.get("num_running_reqs") and not info.get("num_queued_reqs"):
            return info
        time.sleep(0.5)
    return info


def memory_snapshot(pid: int | None, info: dict) -> dict:
    """RSS of every server process by role, and the scheduler's memory report."""
    out: dict = {"memory": info.get("memory")}
    if pid is not None:
        roles = process_roles(pid)
        out["rss_mb"] = {f"{roles.get(str(p), 'pid')}:{p}": round(rss_mb(p), 1) for p in process_tree(pid)}
    return out


def scheduler_rss(snapshot: dict) -> float | None:
    """The scheduler's RSS: its own report where the server gives one, else its process's."""
    mem = snapshot.get("memory") or {}
    if mem.get("rss_mb") is not None:
        return float(mem["rss_mb"])
    for name, mb in (snapshot.get("rss_mb") or {}).items():
        if name.startswith("scheduler:"):
            return mb
    return None


def run_config(url: str, pid: int | None, kind: str, args) -> dict:
    """`args.rounds` rounds of `args.concurrency` requests; the growth and throughput verdicts."""
    rows = []
    before = memory_snapshot(pid, wait_idle(url))
    for r in range(args.rounds):
        texts = prompts(kind, r, args.concurrency, args.seed)
        row = asyncio.run(one_round(url, texts, args, args.abort_share))
        row.update(memory_snapshot(pid, wait_idle(url)))
        row["scheduler_rss_mb"] = scheduler_rss(row)
        rows.append(row)
        print(
            f"  {kind} round {r + 1}/{args.rounds}: {row['requests']} requests, {row['failed']} failed, "
            f"{row['output_tok_s']} tok/s, scheduler RSS {row['scheduler_rss_mb']} MB",
            flush=True,
        )
    first, last = rows[0], rows[-1]
    later = sum(row["requests"] for row in rows[1:])
    growth = None
    if later and first["scheduler_rss_mb"] is not None and last["scheduler_rss_mb"] is not None:
        growth = (last["scheduler_rss_mb"] - first["scheduler_rss_mb"]) / later * 1000
    worst = min(row["output_tok_s"] for row in rows) / first["output_tok_s"] if first["output_tok_s"] else 0.0
    failed = sum(row["failed"] for row in rows)
    return {
        "prompts": kind,
        "before": before,
        "rounds": rows,
        "growth_mb_per_1k_after_first": None if growth is None else round(growth, 2),
        "worst_round_tput_ratio": round(worst, 3),
        "failed": failed,
        "ok": failed == 0 and (growth is None or growth <= GROWTH_MB_PER_1K) and worst >= MIN_TPUT_RATIO,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rss, tput) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for res in results:
        label = f"{res['prompts']}, speculation {res['speculative']}"
        xs = [i + 1 for i in range(len(res["rounds"]))]
        rss.plot(xs, [r["scheduler_rss_mb"] for r in res["rounds"]], marker="o", label=label)
        tput.plot(xs, [r["output_tok_s"] for r in res["rounds"]], marker="o", label=label)
    rss.set_ylabel("scheduler RSS after round (MB)")
    tput.set_ylabel("output tok/s in round")
    tput.set_xlabel(f"round ({results[0]['concurrency']} concurrent streaming requests each)")
    rss.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=1000, help="requests opened at once per round")
    ap.add_argument("--prompts", default="repeated,distinct", help="repeated, distinct, or both")
    ap.add_argument("--speculative", default="on,off", help="on (the default suffix), off, or both")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--abort-share", type=float, default=0.0, help="share of clients that leave mid-stream")
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="", help="extra args for the servers it starts")
    ap.add_argument("--url", help="use a running server (one configuration: its own flags)")
    ap.add_argument("--server-pid", type=int, help="pid of the --url server, to sample its processes' RSS")
    ap.add_argument("--out", default=str(RESULTS / "burst.json"))
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.prompts.split(",") if k.strip()]
    specs = [s.strip() for s in args.speculative.split(",") if s.strip()]
    if set(kinds) - {"repeated", "distinct"} or set(specs) - {"on", "off"}:
        ap.error("--prompts takes repeated/distinct, --speculative on/off")
    results = []
    for spec in [None] if args.url else specs:
        for kind in kinds:
            if args.url:
                url, pid, proc = args.url.rstrip("/"), args.server_pid, None
            else:  # a fresh server per configuration: each starts from the same memory
                extra = args.server_args.split()
                if spec == "off":
                    extra += ["--speculative-algorithm", "none"]
                log = Path(tempfile.gettempdir()) / f"radixlm-burst-server-{os.getpid()}.log"
                proc, url = start_server(extra, log)
                pid = proc.pid
                print(f"server pid {pid} ({' '.join(extra) or 'default flags'}), log {log}", flush=True)
            try:
                res = run_config(url, pid, kind, args)
            finally:
                if proc is not None:
                    stop_server(proc)
            res.update(speculative=spec or "server's", concurrency=args.concurrency)
            results.append(res)
            print(
                f"{kind}, speculation {res['speculative']}: growth after round 1 "
                f"{res['growth_mb_per_1k_after_first']} MB per 1,000 requests, worst round "
                f"{res['worst_round_tput_ratio']}x of the first, {res['failed']} failed: "
                f"{'OK' if res['ok'] else 'MISSED'}",
                flush=True,
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"name": "burst", "command": " ".join(["python -m bench.burst", *(argv or sys.argv[1:])]),
           "environment": environment(), "targets": {"growth_mb_per_1k": GROWTH_MB_PER_1K,
           "min_tput_ratio": MIN_TPUT_RATIO}, "results": results}  # fmt: skip
    out.write_text(json.dumps(doc, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
