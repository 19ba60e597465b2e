"""KV cache events read by a consumer that is not ours: vLLM's own event types (`vllm.distributed.kv_events`,
in the peers' environment that `make bench-peers` builds) decode every batch a real scheduler published, as
a subscriber that joined late and asked the replay socket for the gap (every batch before it joined).

Skips, saying so, where the peers' environment is absent."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import msgspec
import pytest

from bench.harness.peers import PeerNotInstalled, vllm_python
from runtime.managers.scheduler.kv_events import KVEventBatch
from runtime.messages import GenerateReq
from runtime.sampling_params import SamplingParams
from tests.e2e.server_utils import free_port
from tests.scheduler_utils import make_scheduler

pytestmark = pytest.mark.timeout(600)

# Runs in the peers' python: replay from sequence 0, decode each batch with vLLM's KVEventBatch, print JSON.
CONSUMER = r"""
import json, sys
import msgspec, zmq
from vllm.distributed.kv_events import KVEventBatch

decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[1])
sock.send_multipart([b"", (0).to_bytes(8, "big")])
out = []
while sock.poll(30000):
    _, seq, payload = sock.recv_multipart()
    if not payload:
        break
    batch = decoder.decode(payload)
    events = []
    for e in batch.events:
        kind = type(e).__name__
        fields = {"type": kind}
        for name in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"):
            if hasattr(e, name):
                fields[name] = getattr(e, name)
        events.append(fields)
    out.append({"seq": int.from_bytes(seq, "big"), "rank": batch.data_parallel_rank, "events": events})
print(json.dumps(out))
"""


def ours(payload: bytes) -> list[dict]:
    """The same batch as radixlm's own schema reads it, in the consumer's JSON shape."""
    events = []
    for e in msgspec.msgpack.decode(payload, type=KVEventBatch).events:
        fields = {"type": type(e).__name__}
        for name in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"):
            if hasattr(e, name):
                fields[name] = getattr(e, name)
        events.append(fields)
    return events


def test_vllm_decodes_every_published_batch_through_replay(tiny_model_dir, default_tokenizer):
    try:
        py = vllm_python()
    except PeerNotInstalled as e:
        pytest.skip(f"vLLM's event types are read in the peers' environment: {e}")
    port, replay_port = free_port(), free_port()
    config = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        }
    )
    events = {"kv_events_config": config, "kv_events_block_size": 4}
    s = make_scheduler(tiny_model_dir, default_tokenizer, max_total_tokens=96, **events)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True, temperature=0)
    shared = list(range(20, 44))
    for i, tail in enumerate(([50, 51, 52, 53, 54], [60, 61, 62], list(range(100, 170)))):  # the last evicts
        s.handle(GenerateReq(rid=f"r{i}", input_ids=shared + tail, params=params))
        while s.has_work():
            s.step()
            s.publish_events()
    s.flush_cache()
    s.publish_events()
    published = list(s.kv_publisher.buffer)
    assert len(published) >= 3
    consumer = subprocess.Popen(
        [str(py), "-c", CONSUMER, f"tcp://127.0.0.1:{replay_port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300  # vLLM's import takes a while
        while consumer.poll() is None and time.monotonic() < deadline:
            s.kv_publisher.serve_replay()
            time.sleep(0.02)
        out, err = consumer.communicate(timeout=30)
    finally:
        if consumer.poll() is None:
            consumer.kill()
        s.kv_publisher.close()
    assert consumer.returncode == 0, err[-3000:]
    got = json.loads(out)
    assert [b["seq"] for b in got] == [seq for seq, _ in published]  # the whole gap, in order
    assert [b["events"] for b in got] == [ours(payload) for _, payload in published]
    kinds = {e["type"] for b in got for e in b["events"]}
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= kinds, kinds
    print(f"vLLM ({sys.executable} beside {py}) decoded {len(got)} batches, events {sorted(kinds)}")
