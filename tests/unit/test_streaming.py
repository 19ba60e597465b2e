"""The shared streaming loop with a scripted tokenizer manager: text deltas, logprob offsets, finals order,
and that the prompt shared by n choices is prepared before any choice streams."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from runtime.entrypoints.http_common import SSE_DONE
from runtime.entrypoints.streaming import stream_events


def out(text: str, n_lp: int, finish: str | None = None) -> dict[str, Any]:
    meta = {"output_token_logprobs": [[-0.1, 7, "x"]] * n_lp, "finish_reason": finish and {"type": finish}}
    return {"text": text, "meta_info": meta}


class ScriptedTM:
    """Stands in for TokenizerManager: `prepare_choices` records the call, `generate` replays a script."""

    def __init__(self, scripts: dict[str, list[dict[str, Any]]]):
        self.scripts = scripts
        self.calls: list[str] = []

    async def prepare_choices(self, reqs):
        self.calls.append("prepare")
        return [rid for rid in self.scripts]

    async def generate(self, rid):
        self.calls.append(f"generate {rid}")
        for o in self.scripts[rid]:
            await asyncio.sleep(0)
            yield o


class Recorder:
    def __init__(self):
        self.updates: list[tuple[int, str, int]] = []

    def start(self, num_choices):
        return [f"start {num_choices}".encode()]

    def update(self, index, o, text_delta, logprob_start):
        self.updates.append((index, text_delta, logprob_start))
        if text_delta == "" and not o["meta_info"]["finish_reason"]:
            return None
        return json.dumps(index).encode()

    def end(self, finals):
        return [("end " + ",".join(f["text"] for f in finals)).encode()]


def collect(tm, fmt) -> list[bytes]:
    async def go():
        return [e async for e in stream_events(tm, ["base"], fmt)]

    return asyncio.run(go())


def test_deltas_offsets_and_final_order():
    tm = ScriptedTM(
        {
            "a": [out("He", 1), out("Hello", 2), out("Hello!", 3, "stop")],
            "b": [out("Yo", 1), out("Yo", 2), out("Yo.", 3, "length")],
        }
    )
    fmt = Recorder()
    events = collect(tm, fmt)
    assert tm.calls[0] == "prepare"  # the shared prompt is prefilled before any choice starts
    assert events[0] == b"start 2" and events[-2:] == [b"end Hello!,Yo.", SSE_DONE]
    a = [(d, s) for i, d, s in fmt.updates if i == 0]
    b = [(d, s) for i, d, s in fmt.updates if i == 1]
    assert a == [("He", 0), ("llo", 1), ("!", 2)]
    # b's second update had no text: nothing was sent, so its logprob entry goes out with the next one.
    assert b == [("Yo", 0), ("", 1), (".", 1)]
    assert len(events) == 2 + 5 + 1


def test_error_from_a_choice_propagates():
    class Failing(ScriptedTM):
        async def generate(self, rid):
            yield out("a", 1)
            raise RuntimeError("scheduler died")

    with pytest.raises(RuntimeError, match="scheduler died"):
        collect(Failing({"a": []}), Recorder())
