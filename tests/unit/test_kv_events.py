"""KV cache events (`kv_events`): the radix tree's inserts, evictions and resets become vLLM's BlockStored /
BlockRemoved / AllBlocksCleared over fixed blocks with chained hashes; the ZMQ publisher's batches decode
with the documented schema, sequence numbers count up, and the replay socket resends what a subscriber
missed; a scheduler with events on reports a request's prompt blocks."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import torch
import zmq

from runtime.managers.scheduler.kv_events import (
    AllBlocksCleared,
    BlockEvents,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    ZmqEventPublisher,
    path_hashes,
    replica_endpoint,
)
from runtime.mem_cache.radix_cache import RadixCache
from runtime.messages import GenerateReq
from runtime.sampling_params import SamplingParams
from tests.e2e.server_utils import free_port
from tests.scheduler_utils import make_scheduler


def tree(block_size: int = 4) -> tuple[RadixCache, BlockEvents]:
    cache, events = RadixCache(), BlockEvents(block_size, "CPU")
    cache.events = events
    return cache, events


def test_stored_blocks_are_the_complete_blocks_a_new_leaf_finishes():
    cache, events = tree()
    cache.insert(list(range(10)), torch.arange(10))  # blocks 0, 1 complete; 2 tokens left over
    (first,) = events.take()
    assert (
        isinstance(first, BlockStored)
        and first.token_ids == list(range(8))
        and first.parent_block_hash is None
    )
    assert first.block_hashes == path_hashes(tuple(range(10)), 2, 4)
    cache.insert(list(range(14)), torch.arange(14))  # extends the path: block 2 is now complete
    (second,) = events.take()
    assert second.token_ids == [8, 9, 10, 11] and second.parent_block_hash == first.block_hashes[-1]
    cache.insert(list(range(6)) + [99, 98, 97], torch.arange(100, 109))  # branches inside block 1
    (third,) = events.take()
    assert third.token_ids == [4, 5, 99, 98] and third.parent_block_hash == first.block_hashes[0]
    assert third.block_hashes[0] != first.block_hashes[1]  # the same position, other tokens
    cache.insert(list(range(3)), torch.arange(3))  # already cached: nothing new
    assert events.take() == []


def test_eviction_removes_the_blocks_it_cuts_and_reset_clears():
    cache, events = tree()
    cache.insert(list(range(8)), torch.arange(8))
    cache.insert(list(range(4)) + [50, 51, 52, 53, 54], torch.arange(10, 19))
    first, _branch = events.take()
    cache.evict(4)  # the least recently used leaf: tokens 4..7, the first path's second block
    (removed,) = events.take()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == first.block_hashes[1:]
    cache.reset()
    assert [type(e) for e in events.take()] == [AllBlocksCleared]


def test_salted_paths_hash_apart_and_report_token_ids():
    cache, events = tree()
    salt = (7 + 1) << 32
    cache.insert(list(range(8)), torch.arange(8))
    cache.insert([t + salt for t in range(8)], torch.arange(8, 16))
    plain, salted = events.take()
    assert salted.token_ids == plain.token_ids == list(range(8))
    assert set(salted.block_hashes).isdisjoint(plain.block_hashes)
    assert plain.extra_keys is None and salted.extra_keys == [("salt:8",)] * 2  # one entry per block


def test_publisher_batches_decode_and_replay_resends_what_was_missed():
    port, replay_port = free_port(), free_port()
    config = KVEventsConfig.parse(
        json.dumps(
            {
                "enable_kv_cache_events": True,
                "endpoint": f"tcp://127.0.0.1:{port}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                "topic": "kv",
            }
        )
    )
    pub = ZmqEventPublisher(config)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        got = []
        for _attempt in range(50):  # a PUB drops messages until the subscription has arrived
            pub.publish([AllBlocksCleared()])
            if sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                got.append(int.from_bytes(seq, "big"))
                assert topic == b"kv" and isinstance(decoder.decode(payload).events[0], AllBlocksCleared)
                break
        assert got, "no batch arrived"
        pub.publish([BlockRemoved(block_hashes=[1, 2], medium="CPU")])
        _, seq, payload = sub.recv_multipart()
        assert int.from_bytes(seq, "big") == got[0] + 1
        req = ctx.socket(zmq.DEALER)
        req.connect(f"tcp://127.0.0.1:{replay_port}")
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        for _ in range(100):
            pub.serve_replay()
            if req.poll(50):
                _, seq_b, body = req.recv_multipart()
                if not body:
                    break
                frames.append(int.from_bytes(seq_b, "big"))
        assert frames == list(range(pub.seq))  # every batch kept, in order, then the end marker
        req.close(0)
    finally:
        sub.close(0)
        pub.close()


@pytest.mark.parametrize("text", ['{"enable_kv_cache_events": true, "publisher": "kafka"}', "[1]", "{"])
def test_a_bad_config_names_the_problem(text):
    with pytest.raises(ValueError, match="kv-events-config"):
        KVEventsConfig.parse(text)


def test_disabled_config_is_off():
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}') is None


def test_the_scheduler_reports_a_requests_prompt_blocks(tiny_model_dir, default_tokenizer):
    config = '{"enable_kv_cache_events": true, "publisher": "null"}'
    s = make_scheduler(tiny_model_dir, default_tokenizer, kv_events_config=config, kv_events_block_size=4)
    prompt = list(range(20, 38))  # 18 tokens
    s.handle(GenerateReq(rid="r", input_ids=prompt, params=SamplingParams(max_new_tokens=3, ignore_eos=True)))
    while s.has_work():
        s.step()
    events = s.kv_events.take()
    stored = [e for e in events if isinstance(e, BlockStored)]
    tokens = [t for e in stored for t in e.token_ids]
    assert tokens[:16] == prompt[:16]  # the prompt's complete blocks, in order
    assert s.flush_cache() and isinstance(s.kv_events.take()[-1], AllBlocksCleared)


def test_host_tier_blocks_are_reported_with_their_medium(tiny_model_dir, default_tokenizer):
    """A prefix the device evicts into the host tier is removed from "CPU" and stored on "HOST" with the
    same hashes; loaded back for the next request, it is stored on "CPU" again (the host keeps its copy)."""
    config = '{"enable_kv_cache_events": true, "publisher": "null"}'
    s = make_scheduler(
        tiny_model_dir,
        default_tokenizer,
        kv_events_config=config,
        kv_events_block_size=4,
        kv_host_tier_gb=0.01,
        max_total_tokens=96,
    )

    def run(rid: str, prompt: list[int]) -> list:
        params = SamplingParams(max_new_tokens=2, ignore_eos=True, temperature=0)
        s.handle(GenerateReq(rid=rid, input_ids=prompt, params=params))
        while s.has_work():
            s.step()
        return s.kv_events.take()

    first = list(range(20, 60))  # 40 tokens: 10 blocks
    stored = [e for e in run("a", first) if isinstance(e, BlockStored)]
    assert {e.medium for e in stored} == {"CPU"}
    device_hashes = [h for e in stored for h in e.block_hashes]
    events = run("b", list(range(100, 170)))  # 70 tokens: the pool must evict the first prompt
    removed = {h for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU" for h in e.block_hashes}
    on_host = {h for e in events if isinstance(e, BlockStored) and e.medium == "HOST" for h in e.block_hashes}
    assert device_hashes[0] in removed and device_hashes[0] in on_host, events
    events = run("c", first)  # served from the host tier: back on the device
    back = {h for e in events if isinstance(e, BlockStored) and e.medium == "CPU" for h in e.block_hashes}
    assert device_hashes[0] in back, events
    assert not any(isinstance(e, BlockRemoved) and e.medium == "HOST" and device_hashes[0] in e.block_hashes
                   for e in events)  # fmt: skip


def test_a_data_parallel_replica_publishes_its_rank_on_its_own_ports():
    """Replica r binds the endpoints' TCP ports + r (another transport: the address + _dp<r>) and stamps
    its batches with data_parallel_rank r, as vLLM's replicas do; rank 0 binds the endpoints as given."""
    assert replica_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert replica_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert replica_endpoint("ipc:///tmp/ev", 1) == "ipc:///tmp/ev_dp1"
    with pytest.raises(ValueError, match="no port"):
        replica_endpoint("tcp://host", 1)
    base = free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{base}")
    pub = ZmqEventPublisher(config, data_parallel_rank=1)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 5000)
        sub.connect(f"tcp://127.0.0.1:{base + 1}")
        batch = None
        for _ in range(50):  # a PUB drops what it sends before the subscription arrives: send until seen
            pub.publish([AllBlocksCleared()])
            try:
                batch = msgspec.msgpack.decode(sub.recv_multipart(zmq.NOBLOCK)[2], type=KVEventBatch)
                break
            except zmq.Again:
                time.sleep(0.05)
        assert batch is not None and batch.data_parallel_rank == 1
    finally:
        sub.close(0)
        pub.close()


def test_disk_tier_files_are_announced_once_written_and_removed_when_the_cap_deletes_them(
    tiny_model_dir, default_tokenizer, tmp_path
):
    """A cached prompt's 64-token disk files are a "DISK" BlockStored, with the device's own hashes, once the
    writer has written them; a file the size cap deletes is a "DISK" BlockRemoved of the same hashes."""
    config = '{"enable_kv_cache_events": true, "publisher": "null"}'
    s = make_scheduler(
        tiny_model_dir,
        default_tokenizer,
        kv_events_config=config,
        kv_events_block_size=16,
        kv_disk_dir=str(tmp_path / "kv"),
    )

    def run(rid: str, prompt: list[int]) -> list:
        params = SamplingParams(max_new_tokens=2, ignore_eos=True, temperature=0)
        s.handle(GenerateReq(rid=rid, input_ids=prompt, params=params))
        while s.has_work():
            s.step()
        assert s.cm.disk.flush()
        return s.collect_events()

    first = list(range(20, 160))  # 140 tokens: 2 disk files (128 tokens), 8 blocks of 16
    events = run("a", first)
    device = [h for e in events if isinstance(e, BlockStored) and e.medium == "CPU" for h in e.block_hashes]
    disk = [e for e in events if isinstance(e, BlockStored) and e.medium == "DISK"]
    assert [len(e.block_hashes) for e in disk] == [4, 4]
    assert [h for e in disk for h in e.block_hashes] == device[:8] == path_hashes(first, 8, 16)
    assert disk[0].parent_block_hash is None and disk[1].parent_block_hash == device[3]
    assert disk[1].token_ids == first[64:128]

    files = sorted((tmp_path / "kv").iterdir())
    # room for two files (token ids past 255 pickle a little longer): the next prompt's two evict the first's
    s.cm.disk.cap_bytes = sum(f.stat().st_size for f in files) + 1024
    events = run("b", list(range(300, 440)))
    removed = {
        h for e in events if isinstance(e, BlockRemoved) and e.medium == "DISK" for h in e.block_hashes
    }
    stored = [h for e in events if isinstance(e, BlockStored) and e.medium == "DISK" for h in e.block_hashes]
    assert len(stored) == 8 and removed == set(device[:8])


def test_span_blocks_give_a_straddling_block_to_the_span_that_completes_it():
    """Blocks of 48 over files of 64: file i announces the blocks whose last token lies in it, the path
    hashed once, each span's parent the block before it."""
    events = BlockEvents(48, "DISK")
    key = list(range(1000, 1192))  # 3 files of 64 tokens, 4 blocks of 48
    spans = events.span_blocks(key, 64, 3)
    hashes = path_hashes(key, 4, 48)
    assert [s.hashes for s in spans] == [hashes[:1], hashes[1:2], hashes[2:4]]
    assert [s.parent for s in spans] == [None, hashes[0], hashes[1]]
    assert spans[2].tokens == key[96:192]
    assert BlockEvents(128, "DISK").span_blocks(key, 64, 3)[0] is None  # no block ends in the first file
