"""The offline Engine on the default model: real scheduler and detokenizer processes, no HTTP."""

from __future__ import annotations

import asyncio
import os
import random
import re
from pathlib import Path

import pytest

from runtime import Engine
from tests.e2e.server_utils import descendants


@pytest.fixture(scope="module")
def engine():
    eng = Engine(
        max_total_tokens=16384,
        log_level="warning",
        max_running_requests=32,
        dtype="float32",
        quantization="none",
        kv_cache_dtype="float32",
    )
    yield eng
    pids = [p.pid for p in eng.tm.supervisor.procs.values()]
    eng.shutdown()
    for pid in pids:  # no orphan: the children are gone (reaped) after shutdown
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie_free(pid), f"child {pid} survived shutdown"


def _is_zombie_free(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" in f.read().lower()
    except FileNotFoundError:
        return True


def test_shared_system_prompt_hits_cache(engine):
    rng = random.Random(0)
    words = "agent tool call schema observe plan reply user memory context search result".split()
    system = "You are a careful agent. Tools: " + " ".join(rng.choice(words) for _ in range(300))
    prompts = [f"{system}\nQuestion {i}: what is {i} plus {i}?" for i in range(64)]
    assert len(engine.tokenizer.encode(system)) >= 300
    outs = engine.generate(prompts, {"max_new_tokens": 4, "temperature": 0})
    assert len(outs) == 64
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    # Only the first prefill wave can miss; everything after reuses the system prompt's KV.
    assert sum(c >= 290 for c in cached) >= 60, cached
    assert all(o["meta_info"]["completion_tokens"] == 4 for o in outs)
    info = engine.server_info()
    assert info["num_running_reqs"] == 0 and info["cache_hit_rate"] > 0.7


def test_greedy_same_with_and_without_cache_hit(engine):
    prompt = "The three primary colors are"
    first = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0})
    second = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0})
    assert second["meta_info"]["cached_tokens"] > 0
    assert first["text"] == second["text"]


def test_stream_matches_non_stream(engine):
    prompt = "List three fruits:"
    full = engine.generate(prompt, {"max_new_tokens": 10, "temperature": 0})
    chunks = list(engine.generate(prompt, {"max_new_tokens": 10, "temperature": 0}, stream=True))
    assert len(chunks) > 1
    assert chunks[-1]["text"] == full["text"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))


def test_async_generate_and_errors(engine):
    async def go():
        return await engine.async_generate("Hello", {"max_new_tokens": 3, "temperature": 0})

    out = asyncio.run(go())
    assert out["meta_info"]["completion_tokens"] == 3
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate("x", {"max_new_tokens": -5})
    from runtime.errors import RequestError

    with pytest.raises(RequestError, match="context length"):
        engine.generate("x", {"max_new_tokens": 10_000_000 // 10})


def _cmdline(pid: int) -> str:
    """argv as `ps` shows it (setproctitle rewrites argv in place; the tail may be NUL padding)."""
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def test_children_are_named_in_ps(engine):
    # A regex request starts the grammar checker child (it is spawned on first use).
    out = engine.generate("Pick a digit:", {"max_new_tokens": 3, "temperature": 0, "regex": "[0-9]"})
    assert re.fullmatch("[0-9]", out["text"]), out["text"]
    procs = engine.tm.supervisor.procs
    assert _cmdline(procs["scheduler"].pid) == "radixlm::scheduler"
    assert _cmdline(procs["detokenizer"].pid) == "radixlm::detokenizer"
    titles = {_cmdline(pid) for pid in descendants(os.getpid())}
    assert {"radixlm::scheduler", "radixlm::detokenizer", "radixlm::grammar"} <= titles, titles
