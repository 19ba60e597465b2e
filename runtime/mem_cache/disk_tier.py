"""Disk tier under the radix cache: cached prefixes survive a restart in `--kv-disk-dir`.

A cache key is cut into blocks of BLOCK tokens; block i's file holds the KV of tokens [i*B, (i+1)*B) and is
named by a chained hash: h_i = blake2b(h_{i-1}, the model's identity, the dtype, block i's tokens), so a file
stands for exactly one prefix of one model in one dtype. Files are written by a background thread (tmp file +
rename: a reader never sees a half-written entry) from copies taken when a prefix enters the device cache, and
the queue is drained on a graceful shutdown. The directory is capped at `--kv-disk-gb`; past it the least
hit files go first, least recently used among equals. A block's hits are its write, its loads from disk and
the device (or host) matches over it that the cache manager reports, aged (LFU with dynamic aging: the score
is the hits plus the score of the last evicted block when it was last hit or written), so blocks hit often
long ago cannot keep every new prefix off the disk. Counts live in memory: after a restart every file starts
at 0 and its mtime orders them. On a lookup the longest run of consecutive blocks on disk is loaded; each
file's header (identity, dtype, shape, tokens) is checked before use, and a file that fails (corrupt, another
model or dtype, another prefix) is ignored with a warning and deleted, never used.

The files hold every tenant's token ids (salted ids included), and a planted file would be read as KV: the
directory must be ours and writable by nobody else (`cache_dir.private_dir`, else `UnsafeCacheDir`), files
are created 0600 under an unpredictable temporary name with O_EXCL | O_NOFOLLOW (a planted symlink is
never followed), and a file is read only when it is a regular file of ours that no one else can write.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import os
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runtime.cache_dir import private_dir, unsafe_reason
from runtime.mem_cache.memory_pool import KVPool

logger = logging.getLogger("radixlm.disk_tier")

BLOCK = 64  # tokens per file
SUFFIX = ".kv"
QUEUE_BLOCKS = 1024  # blocks waiting to be written at most; past it new blocks are not written


@dataclass
class _File:
    size: int
    used: float  # last write, load or reported hit (time.time())
    hits: int = 0
    score: float = 0.0  # hits + the aging level when last touched: the lowest goes first


class DiskTier:
    def __init__(self, directory: str, cap_bytes: int, device_pool: KVPool, identity: str):
        self.dir = directory
        self.cap_bytes = cap_bytes
        self.device_pool = device_pool
        self.identity = identity
        self.dtype = str(device_pool.dtype).removeprefix("torch.")
        self._salt = f"{identity}|{self.dtype}".encode()
        private_dir(directory)  # UnsafeCacheDir when another user owns it or could write into it
        self._lock = threading.Lock()
        self._index: dict[str, _File] = {}
        for name in os.listdir(directory):
            if not name.endswith(SUFFIX):
                continue
            st = os.lstat(os.path.join(directory, name))
            if unsafe_reason(st) is None:  # a link, or a file another user could have written: not ours
                self._index[name[: -len(SUFFIX)]] = _File(st.st_size, st.st_mtime)
        self._used = sum(f.size for f in self._index.values())
        self._age = 0.0  # the score of the last evicted file (LFU-DA's inflation level)
        self._pending: set[str] = set()
        self._queue: queue.Queue = queue.Queue(QUEUE_BLOCKS)
        self.counts = dict(
            disk_written_blocks=0, disk_loaded_tokens=0, disk_rejected_files=0, disk_dropped=0, disk_evicted=0
        )
        # KV cache events (--kv-events-config; set by the scheduler): `announce(key, BLOCK, n)` hashes a
        # path's first n files' blocks in the scheduler's thread; the writer reports a written file's blocks,
        # and the cap (or a failed read) a deleted one's, through `_events`, drained each step (`take_events`)
        self.announce: Callable[[list[int], int, int], list[Any]] | None = None
        self._announced: dict[str, Any] = {}  # a written file's blocks, for its removal (under self._lock)
        self._events: deque[tuple[str, Any]] = deque()  # ("stored" | "removed", blocks): thread-safe ends
        self._writer = threading.Thread(target=self._write_loop, name="radixlm-kv-disk", daemon=True)
        self._writer.start()

    # ---- naming --------------------------------------------------------------------------------------
    def block_names(self, key: list[int] | tuple[int, ...]) -> list[str]:
        """The file names of the full blocks of `key`, in order."""
        names, prev = [], b""
        for i in range(len(key) // BLOCK):
            ids = ",".join(map(str, key[i * BLOCK : (i + 1) * BLOCK])).encode()  # salted keys pass 2**64
            h = hashlib.blake2b(prev + self._salt + ids, digest_size=20)
            prev = h.digest()
            names.append(h.hexdigest())
        return names

    def cached_len(self, names: list[str]) -> int:
        """Tokens of the longest run of blocks, from the first, that are on disk."""
        with self._lock:
            n = next((i for i, name in enumerate(names) if name not in self._index), len(names))
        return n * BLOCK

    def hit(self, names: list[str]) -> None:
        """Count a use of these blocks that did not read them (the device or host tier held them)."""
        now = time.time()
        with self._lock:
            for name in names:
                if (f := self._index.get(name)) is not None:
                    self._touch(f, now)

    def _touch(self, f: _File, now: float) -> None:  # under self._lock
        f.hits += 1
        f.used = now
        f.score = self._age + f.hits

    # ---- device -> disk (background) -----------------------------------------------------------------
    def offer(self, key: list[int], device_slots: torch.Tensor, wait_s: float = 0.0) -> int:
        """Queue the full blocks of a just-cached prefix that are not on disk yet (their KV is copied now:
        the slots may be reused before the writer runs). Returns the blocks queued. With the queue full a
        block is dropped (serving must not wait for the disk), unless `wait_s` allows waiting for room (a
        graceful stop, which offers the whole cache at once)."""
        names = self.block_names(key)
        blocks = self.announce(key, BLOCK, len(names)) if self.announce is not None else None
        queued = 0
        for i, name in enumerate(names):
            with self._lock:
                if name in self._index or name in self._pending:
                    continue
                self._pending.add(name)
            sl = device_slots[i * BLOCK : (i + 1) * BLOCK].to(self.device_pool.k[0].device)
            k = torch.stack([layer.index_select(0, sl) for layer in self.device_pool.k]).cpu()
            v = torch.stack([layer.index_select(0, sl) for layer in self.device_pool.v]).cpu()
            entry = {
                "identity": self.identity,
                "dtype": self.dtype,
                "tokens": [int(t) for t in key[i * BLOCK : (i + 1) * BLOCK]],
                "prev": names[i - 1] if i else "",
                "k": k,
                "v": v,
            }
            try:
                item = (name, entry, blocks[i] if blocks else None)
                self._queue.put(item, block=wait_s > 0, timeout=wait_s if wait_s > 0 else None)
                queued += 1
            except queue.Full:
                with self._lock:
                    self._pending.discard(name)
                self.counts["disk_dropped"] += 1
                break
        return queued

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:
                logger.exception("writing a KV block to %s failed", self.dir)
            finally:
                self._queue.task_done()

    def _write(self, name: str, entry: dict, blocks: Any = None) -> None:
        path = os.path.join(self.dir, name + SUFFIX)
        tmp = f"{path}.tmp{secrets.token_hex(8)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                torch.save(entry, f)
            os.replace(tmp, path)  # replaces a planted link itself, never its target
        finally:
            with self._lock:
                self._pending.discard(name)
            if os.path.exists(tmp):
                os.unlink(tmp)
        size = os.path.getsize(path)
        with self._lock:
            old = self._index.pop(name, None)
            self._used += size - (old.size if old else 0)
            # a written block counts as hit once: a new prefix competes with old ones at the current age
            self._index[name] = _File(size, time.time(), 1, self._age + 1)
            if blocks is not None:
                self._announced[name] = blocks
                self._events.append(("stored", blocks))
        self.counts["disk_written_blocks"] += 1
        self._enforce_cap()

    def _enforce_cap(self) -> None:
        """Past the cap, delete the lowest-scored files (least hit, aged), least recently used first."""
        with self._lock:
            if self._used <= self.cap_bytes:
                return
            heap = [(f.score, f.used, name) for name, f in self._index.items()]
            heapq.heapify(heap)  # O(n), then O(log n) per victim: the writer holds the lock briefly
            victims = []
            while heap and self._used > self.cap_bytes:
                score, _, name = heapq.heappop(heap)
                victims.append(name)
                self._used -= self._index.pop(name).size
                self._age = max(self._age, score)
                if (blocks := self._announced.pop(name, None)) is not None:
                    self._events.append(("removed", blocks))
            self.counts["disk_evicted"] += len(victims)
        for name in victims:
            try:
                os.unlink(os.path.join(self.dir, name + SUFFIX))
            except FileNotFoundError:
                pass

    def take_events(self) -> list[tuple[str, Any]]:
        """The ("stored" | "removed", blocks) reports since the last call, in the order they happened."""
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued block is written (graceful shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    # ---- disk -> device ------------------------------------------------------------------------------
    def read(self, key: list[int], names: list[str], start: int, end: int) -> tuple[torch.Tensor, ...] | None:
        """K and V [layers, tokens, heads, dim] of key[start:end] (block-aligned end) from the files, or the
        longest valid leading part: (k, v, tokens read). None when not even the first block is usable."""
        ks, vs = [], []
        first = start // BLOCK
        for i in range(first, end // BLOCK):
            entry = self._load(names[i], key[i * BLOCK : (i + 1) * BLOCK])
            if entry is None:
                break
            ks.append(entry["k"])
            vs.append(entry["v"])
        if not ks:
            return None
        off = start - first * BLOCK
        k, v = torch.cat(ks, dim=1)[:, off:], torch.cat(vs, dim=1)[:, off:]
        return k, v, k.shape[1]

    def _entry_problem(self, entry: object, tokens: list[int]) -> str | None:
        """Why a loaded file is not the KV block of `tokens` for this model and dtype (None: it is)."""
        pool = self.device_pool
        shape = (pool.num_layers, BLOCK, pool.num_kv_heads, pool.head_dim)
        if not isinstance(entry, dict):
            return "not a KV block"
        if entry.get("identity") != self.identity:
            return f"another model ({str(entry.get('identity'))[:80]!r})"
        if entry.get("dtype") != self.dtype:
            return f"dtype {entry.get('dtype')!r}, this server runs {self.dtype!r}"
        if entry.get("tokens") != [int(t) for t in tokens]:
            return "another prefix"
        for x in ("k", "v"):
            t = entry.get(x)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != pool.dtype:
                return "wrong KV shape or dtype"
        return None

    def _load(self, name: str, tokens: list[int]) -> dict | None:
        path = os.path.join(self.dir, name + SUFFIX)
        entry = None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # a link is refused (ELOOP)
            with os.fdopen(fd, "rb") as f:
                problem = unsafe_reason(os.fstat(f.fileno()))
                if problem is None:
                    entry = torch.load(f, map_location="cpu", weights_only=True)
                    problem = self._entry_problem(entry, tokens)
        except Exception as e:  # unreadable, truncated, not a torch file
            entry, problem = None, f"unreadable ({type(e).__name__}: {str(e)[:120]})"
        if problem is None:
            with self._lock:
                if (f := self._index.get(name)) is not None:
                    self._touch(f, time.time())
            return entry
        logger.warning("ignoring KV disk entry %s: %s", path, problem)
        self.counts["disk_rejected_files"] += 1
        with self._lock:
            if (f := self._index.pop(name, None)) is not None:
                self._used -= f.size
            if (blocks := self._announced.pop(name, None)) is not None:
                self._events.append(("removed", blocks))
        try:
            os.unlink(path)
        except OSError:
            pass
        return None

    def load(self, k: torch.Tensor, v: torch.Tensor, device_slots: torch.Tensor) -> None:
        dev = self.device_pool.k[0].device
        dst = device_slots.to(dev)
        for layer in range(self.device_pool.num_layers):
            self.device_pool.k[layer].index_copy_(0, dst, k[layer].to(dev))
            self.device_pool.v[layer].index_copy_(0, dst, v[layer].to(dev))
        self.counts["disk_loaded_tokens"] += device_slots.numel()

    # ---- sizes ---------------------------------------------------------------------------------------
    def info(self) -> dict:
        with self._lock:
            used, files = self._used, len(self._index)
        return {
            "disk_tier_bytes": self.cap_bytes,
            "disk_tier_used_bytes": used,
            "disk_tier_files": files,
            **self.counts,
        }

    def close(self, timeout_s: float = 60.0) -> None:
        self.flush(timeout_s)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
