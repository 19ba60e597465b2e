"""A real server with --kv-events-config publishes its cache's blocks on ZMQ as vLLM's subscriber example
reads them: a request's prompt blocks arrive as BlockStored with its token ids, /flush_cache as
AllBlocksCleared, and sequence numbers count up by one."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import requests
import zmq

from runtime.managers.scheduler.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess, free_port


@pytest.fixture(scope="module")
def events_server():
    port = free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}
    args = ["--kv-events-config", json.dumps(config), "--kv-events-block-size", "16"]
    with ServerProcess(extra_args=args) as srv:
        yield srv, port


def test_a_requests_prompt_blocks_and_a_flush_are_published(events_server):
    srv, port = events_server
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    time.sleep(0.5)  # the subscription reaches the publisher
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        text = "Tell me about the sea. " * 12
        r = requests.post(
            srv.url + "/generate",
            json={"text": text, "sampling_params": {"max_new_tokens": 2}},
            timeout=HTTP_TIMEOUT_S,
        )
        assert r.status_code == 200, r.text
        prompt_tokens = r.json()["meta_info"]["prompt_tokens"]
        assert requests.post(srv.url + "/flush_cache", timeout=HTTP_TIMEOUT_S).status_code == 200
        events, seqs = [], []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(isinstance(e, AllBlocksCleared) for e in events):
            if sub.poll(500):
                _, seq, payload = sub.recv_multipart()
                seqs.append(int.from_bytes(seq, "big"))
                events += decoder.decode(payload).events
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert sum(len(e.block_hashes) for e in stored) >= prompt_tokens // 16
        assert all(e.block_size == 16 and len(e.token_ids) == 16 * len(e.block_hashes) for e in stored)
        assert isinstance(events[-1], AllBlocksCleared)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        info = requests.get(srv.url + "/get_server_info", timeout=HTTP_TIMEOUT_S).json()
        assert info["kv_event_batches"] >= len(seqs) and info["kv_event_batches_dropped"] == 0
    finally:
        sub.close(0)
