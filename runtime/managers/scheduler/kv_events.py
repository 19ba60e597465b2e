"""KV cache events in vLLM's wire format, for cluster routers that place requests by cached prefix.

The radix tree reports what it caches and drops (`RadixCache.events`: a new leaf, an evicted leaf, a reset);
`BlockEvents` turns that into fixed blocks of `block_size` tokens along each path, the unit routers such as
NVIDIA Dynamo's KV router and vLLM's own subscriber count in:

- `BlockStored`: the complete blocks a new leaf finishes (a block is announced once it is complete; the
  partial tail of a path is not announced until a later insert completes it);
- `BlockRemoved`: the blocks an evicted leaf took with it (a block the eviction cuts is gone too);
- `AllBlocksCleared`: a flush.

`medium` is the tier: the device tier's blocks are "GPU" or "CPU" (where the model runs), the host tier's
(`--kv-host-tier-gb`) "HOST", the disk tier's (`--kv-disk-dir`) "DISK". A leaf the device evicts into the
host tier is a `BlockRemoved` of the device medium and a `BlockStored` of "HOST"; one loaded back is a
`BlockStored` of the device medium (the host tier keeps its copy); the host tier's own evictions are
`BlockRemoved` of "HOST". The disk tier writes files of 64 tokens in a background thread: a file's blocks are
a `BlockStored` of "DISK" in the first batch after it is written (the hashes are computed when the prefix is
offered, in the scheduler's thread) and a `BlockRemoved` of "DISK" when the size cap deletes it; a block that
straddles two files (a block size that does not divide 64) belongs to the later one. Files found on disk at
start-up are served but not announced (their tokens are only read when loaded).

A block's hash chains its path: sha256(parent hash as 8 bytes big-endian (0 for the first block), then each
token id as 4 bytes little-endian, then the salt id as 8 bytes little-endian when the path is salted),
its first 8 bytes read as a signed big-endian int64. Token ids are the model's; a salted path (cache_salt,
tenant, LoRA adapter) carries its salt's opaque 64-bit id in every block's hash and in `extra_keys` (one
`("salt:<hex id>",)` per block, vLLM's per-block shape), so two salts' blocks never share a hash. The
events are vLLM's current structs (tagged msgpack maps; tests/e2e/test_kv_events_vllm.py decodes them
with vLLM's own types).

Behind `--dp-size`, replica r publishes with `data_parallel_rank` r on the endpoints' ports + r
(`replica_endpoint`). `ZmqEventPublisher` sends each step's batch as vLLM does: a multipart [topic,
sequence number (8 bytes big-endian), msgpack `KVEventBatch`] on a PUB socket, keeps the last
`buffer_steps` batches for a ROUTER replay socket (a client sends the first sequence number it lacks; it
gets [sequence, payload] per kept batch, then an end marker with an empty payload), and never blocks the
scheduler: past the socket's high-water mark a batch is dropped and counted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zmq

logger = logging.getLogger("radixlm.kv_events")

_TOKEN_MASK = (1 << 32) - 1  # a cache key element is a token id, plus (salt id << 32) when salted


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events: msgpack maps tagged `type` with the class name, fields left out where they
    hold their default, as vLLM's are (a consumer ignores the fields it does not know)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None  # None: a LoRA adapter's KV is kept apart by the salt (the adapter joins it)
    extra_keys: list[tuple[str, ...] | None] | None = None  # per block: ("salt:<hex id>",) on a salted path


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def block_hash(parent: int | None, tokens: list[int], salt_id: int) -> int:
    """One block's hash (see the module docstring); `path_hashes` computes the same for whole paths."""
    return _hash(parent, np.asarray(tokens, dtype="<u4").tobytes(), salt_id)


def _hash(parent: int | None, token_bytes: bytes, salt_id: int) -> int:
    h = hashlib.sha256((parent or 0).to_bytes(8, "big", signed=True))
    h.update(token_bytes)
    if salt_id:
        h.update(salt_id.to_bytes(8, "little"))
    return int.from_bytes(h.digest()[:8], "big", signed=True)


def path_hashes(key: tuple[int, ...] | list[int], n_blocks: int, block_size: int) -> list[int]:
    """The chained hashes of the first `n_blocks` complete blocks of a cache key (one numpy pass over
    the key: ~1 us a block, where a per-token Python loop took ~8)."""
    arr = np.asarray(key[: n_blocks * block_size], dtype=np.uint64)
    token_bytes = (arr & _TOKEN_MASK).astype("<u4").tobytes()
    salts = (arr[::block_size] >> 32).tolist()
    width = 4 * block_size
    out: list[int] = []
    parent = None
    for i in range(n_blocks):
        parent = _hash(parent, token_bytes[i * width : (i + 1) * width], salts[i])
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class Blocks:
    """Complete blocks first..last-1 of one path, hashed: what a tier that stores them later (the disk
    tier's writer thread) announces once it holds them, and again once it drops them."""

    hashes: list[int]
    parent: int | None
    tokens: list[int]
    salt_id: int


def _blocks(key, hashes: list[int], first: int, last: int, b: int) -> Blocks:
    return Blocks(
        hashes=hashes[first:last],
        parent=hashes[first - 1] if first else None,
        tokens=[t & _TOKEN_MASK for t in key[first * b : last * b]],
        salt_id=key[0] >> 32,
    )


class BlockEvents:
    """The radix tree's listener (`RadixCache.events`): collects one step's events for the publisher."""

    def __init__(self, block_size: int, medium: str, pending: list[KVCacheEvent] | None = None):
        self.block_size, self.medium = block_size, medium
        self.pending: list[KVCacheEvent] = pending if pending is not None else []

    def tier(self, medium: str) -> BlockEvents:
        """A listener for another tier's tree (the host tier's), reporting into the same step's events in
        the order they happen, its blocks marked with `medium`."""
        return BlockEvents(self.block_size, medium, self.pending)

    def stored(self, key: tuple[int, ...], start: int) -> None:
        """`key[start:]` was just cached (a new leaf of the path `key`)."""
        b = self.block_size
        first, last = start // b, len(key) // b
        if last > first:
            self.stored_blocks(_blocks(key, path_hashes(key, last, b), first, last, b))

    def stored_blocks(self, blocks: Blocks) -> None:
        """Blocks hashed earlier (`span_blocks`) are now held by this listener's tier."""
        n = len(blocks.hashes)
        self.pending.append(
            BlockStored(
                block_hashes=blocks.hashes,
                parent_block_hash=blocks.parent,
                token_ids=blocks.tokens,
                block_size=self.block_size,
                lora_id=None,
                lora_name=None,
                medium=self.medium,
                extra_keys=[(f"salt:{blocks.salt_id:x}",)] * n if blocks.salt_id else None,
            )
        )

    def removed_blocks(self, blocks: Blocks) -> None:
        """Blocks hashed earlier (`span_blocks`) are no longer held by this listener's tier."""
        self.pending.append(BlockRemoved(block_hashes=blocks.hashes, medium=self.medium))

    def report(self, kind: str, blocks: Blocks) -> None:
        """A tier's ("stored" | "removed", blocks) report (`DiskTier.take_events`)."""
        (self.stored_blocks if kind == "stored" else self.removed_blocks)(blocks)

    def span_blocks(self, key: list[int] | tuple[int, ...], span: int, n_spans: int) -> list[Blocks | None]:
        """The blocks of each of the first `n_spans` spans of `span` tokens of `key` (a tier that stores a
        path in pieces, the disk tier's files): span i holds the complete blocks whose last token lies in it
        (None: none does). The path is hashed once."""
        b = self.block_size
        hashes = path_hashes(key, n_spans * span // b, b)
        out: list[Blocks | None] = []
        for i in range(n_spans):
            first, last = i * span // b, (i + 1) * span // b
            out.append(_blocks(key, hashes, first, last, b) if last > first else None)
        return out

    def removed(self, key: tuple[int, ...], start: int) -> None:
        """`key[start:]` was just evicted (a leaf of the path `key`): every complete block past `start`'s
        block goes, the block `start` cuts included."""
        b = self.block_size
        first, last = start // b, len(key) // b
        if last <= first:
            return
        self.pending.append(BlockRemoved(block_hashes=path_hashes(key, last, b)[first:], medium=self.medium))

    def cleared(self) -> None:
        self.pending.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        out = self.pending[:]
        self.pending.clear()  # the list other tiers' listeners share
        return out


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's --kv-events-config JSON (the fields radixlm reads)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # or "null": events are collected and dropped (tests, overhead runs)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = "kv-events"

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig | None:
        """None when off. ValueError naming the field for a bad value."""
        if not text:
            return None
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        # vLLM fields radixlm has no use for are accepted (a config shared with vLLM works as it is)
        config = cls(**{k: v for k, v in raw.items() if k in known})
        if config.publisher not in ("zmq", "null"):
            raise ValueError(
                f"--kv-events-config: publisher must be 'zmq' or 'null', got {config.publisher!r}"
            )
        for name in ("buffer_steps", "hwm"):
            if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
                raise ValueError(f"--kv-events-config: {name} must be a positive integer")
        return config if config.enable_kv_cache_events else None


def replica_endpoint(endpoint: str, rank: int | None) -> str:
    """The endpoint data-parallel replica `rank` binds (vLLM's rule): a TCP port + rank, another transport's
    address + `_dp<rank>`; rank 0 or None binds `endpoint` itself."""
    if not rank:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"--kv-events-config: endpoint {endpoint!r} has no port to offset by dp rank")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class ZmqEventPublisher:
    """PUB the step's batch, keep it for replay, answer replay requests; never block (see the module)."""

    END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None):
        self.config, self.rank = config, data_parallel_rank
        self.encoder = msgspec.msgpack.Encoder()
        self.seq = 0
        self.dropped = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.ctx = zmq.Context.instance()
        self.pub = None
        self.replay = None
        if config.publisher == "zmq":
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.SNDHWM, config.hwm)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.bind(replica_endpoint(config.endpoint, data_parallel_rank))
            if config.replay_endpoint:
                self.replay = self.ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(replica_endpoint(config.replay_endpoint, data_parallel_rank))

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        payload = self.encoder.encode(
            KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank)
        )
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if self.pub is not None:
            try:
                self.pub.send_multipart(
                    [self.config.topic.encode(), seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
                )
            except zmq.Again:
                self.dropped += 1

    def serve_replay(self) -> None:
        """Answer the replay requests waiting on the socket (called every step; returns at once if none)."""
        if self.replay is None:
            return
        while True:
            try:
                frames = self.replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, start = frames[0], int.from_bytes(frames[-1], "big")
            for seq, payload in self.buffer:
                if seq >= start:
                    self._reply(identity, [seq.to_bytes(8, "big"), payload])
            self._reply(identity, [self.END_OF_REPLAY, b""])

    def _reply(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            self.replay.send_multipart([identity, b"", *frames], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def info(self) -> dict[str, int]:
        return {"kv_event_batches": self.seq, "kv_event_batches_dropped": self.dropped}

    def close(self) -> None:
        for sock in (self.pub, self.replay):
            if sock is not None:
                sock.close(0)
