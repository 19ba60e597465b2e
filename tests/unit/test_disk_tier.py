"""Disk KV tier: blocks written in the background (tmp + rename) are found again by a new instance on the
same directory (a restart) and loaded into the device pool; entries of another model or dtype, corrupt or
forged files are refused with a warning and never used; the size cap holds, dropping the least hit blocks
first (aged, so old hits do not lock new prefixes out)."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from runtime.cache_dir import UnsafeCacheDir
from runtime.managers.scheduler.cache_manager import CacheManager
from runtime.managers.scheduler.req import Req
from runtime.mem_cache import disk_tier
from runtime.mem_cache.disk_tier import BLOCK, SUFFIX, DiskTier
from runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool, SlotAllocator
from runtime.mem_cache.radix_cache import RadixCache
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs

POOL = 4 * BLOCK


def make_cm(directory, identity: str = "model-a", dtype=torch.float32, cap: int = 1 << 30) -> CacheManager:
    kv = KVPool(POOL, num_layers=2, num_kv_heads=2, head_dim=4, dtype=dtype)
    disk = DiskTier(str(directory), cap, kv, identity)
    return CacheManager(RadixCache(), ReqToTokenPool(4, 4 * BLOCK), SlotAllocator(POOL), disk=disk)


def fill(cm: CacheManager, prompt: list[int]) -> Req:
    """Run a request's prompt through the cache manager: its KV names its tokens (k = token + layer)."""
    req = Req(rid="r", prompt_ids=prompt, params=SamplingParams(max_new_tokens=1))
    cm.match(req)
    assert cm.start(req)
    slots = cm.alloc_slots(len(prompt) - req.kv_len)
    kv = cm.disk.device_pool
    vals = torch.tensor(prompt[req.kv_len :], dtype=torch.float32)[:, None, None].expand(-1, 2, 4)
    for layer in range(2):
        kv.write(layer, slots, vals + layer, vals - layer)
    cm.append_slots(req, slots)
    return req


def prompt_of(n: int, base: int = 1000) -> list[int]:
    return [base + i for i in range(n)]


def test_a_restart_loads_cached_blocks_from_disk(tmp_path):
    cm = make_cm(tmp_path)
    prompt = prompt_of(2 * BLOCK + 10)
    cm.release(fill(cm, prompt))  # cached: 2 full blocks go to disk in the background
    assert cm.disk.flush()
    assert sorted(os.listdir(tmp_path)) == sorted(n + SUFFIX for n in cm.disk.block_names(prompt))
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]

    fresh = make_cm(tmp_path)  # a new process: empty device cache, same directory
    req = Req(rid="r2", prompt_ids=prompt + [5], params=SamplingParams(max_new_tokens=1))
    assert fresh.match(req) == 0
    assert fresh.start(req)
    assert (req.match_len, req.disk_loaded_len) == (2 * BLOCK, 2 * BLOCK)
    slots = fresh.req_pool.read(req.req_pool_idx, 2 * BLOCK)
    kv = fresh.disk.device_pool
    want = torch.tensor(prompt[: 2 * BLOCK], dtype=torch.float32)
    assert torch.equal(kv.k[1][slots][:, 0, 0], want + 1) and torch.equal(kv.v[1][slots][:, 1, 3], want - 1)
    fresh.check_accounting([req])
    fresh.release(req, cache_tokens=False)
    fresh.check_accounting([])


def test_without_device_room_nothing_is_read_and_the_request_learns_what_waits(tmp_path, monkeypatch):
    cm = make_cm(tmp_path)
    prompt = prompt_of(2 * BLOCK + 10)
    cm.release(fill(cm, prompt))
    assert cm.disk.flush()
    fresh = make_cm(tmp_path)
    held = fresh.alloc_slots(POOL - BLOCK)  # one block of room: the two on disk do not fit
    reads = []
    monkeypatch.setattr(fresh.disk, "_load", lambda *a: reads.append(a))
    req = Req(rid="r2", prompt_ids=prompt + [5], params=SamplingParams(max_new_tokens=1))
    fresh.match(req)
    assert fresh.start(req)
    assert (req.disk_loaded_len, req.tier_unloaded_len, reads) == (0, 2 * BLOCK, [])
    fresh.release(req, cache_tokens=False)
    fresh.allocator.free(held)
    monkeypatch.undo()
    fresh.match(req)
    assert fresh.start(req) and (req.disk_loaded_len, req.tier_unloaded_len) == (2 * BLOCK, 0)
    fresh.release(req, cache_tokens=False)
    fresh.check_accounting([])


@pytest.mark.parametrize("other", [dict(identity="model-b"), dict(dtype=torch.float16)])
def test_entries_of_another_model_or_dtype_are_never_used(tmp_path, other):
    cm = make_cm(tmp_path)
    prompt = prompt_of(BLOCK + 1)
    cm.release(fill(cm, prompt))
    assert cm.disk.flush()
    names = cm.disk.block_names(prompt)
    other_cm = make_cm(tmp_path, **other)
    assert other_cm.disk.block_names(prompt) != names  # keyed by model and dtype: never looked up
    req = Req(rid="r", prompt_ids=prompt, params=SamplingParams(max_new_tokens=1))
    other_cm.match(req)
    assert other_cm.start(req) and req.disk_loaded_len == 0


def test_forged_corrupt_and_mismatched_files_are_refused_with_a_warning(tmp_path, caplog):
    a = make_cm(tmp_path / "a")
    prompt = prompt_of(BLOCK + 1)
    a.release(fill(a, prompt))
    assert a.disk.flush()
    (name,) = a.disk.block_names(prompt)
    b_dir = tmp_path / "b"
    b = make_cm(b_dir, identity="model-b")
    # model-b's name for the prompt, holding model-a's entry (a forged or renamed file)
    (b_name,) = b.disk.block_names(prompt)
    (b_dir / (b_name + SUFFIX)).write_bytes((tmp_path / "a" / (name + SUFFIX)).read_bytes())
    c = make_cm(b_dir, identity="model-b")
    req = Req(rid="r", prompt_ids=prompt, params=SamplingParams(max_new_tokens=1))
    c.match(req)
    with caplog.at_level(logging.WARNING, logger="radixlm.disk_tier"):
        assert c.start(req) and req.disk_loaded_len == 0
    assert "another model" in caplog.text and c.disk.counts["disk_rejected_files"] == 1
    assert not (b_dir / (b_name + SUFFIX)).exists()  # dropped, never used
    c.release(req, cache_tokens=False)
    # a truncated file
    (b_dir / (b_name + SUFFIX)).write_bytes(b"\x80\x02garbage")
    d = make_cm(b_dir, identity="model-b")
    req = Req(rid="r", prompt_ids=prompt, params=SamplingParams(max_new_tokens=1))
    d.match(req)
    with caplog.at_level(logging.WARNING, logger="radixlm.disk_tier"):
        assert d.start(req) and req.disk_loaded_len == 0
    assert "unreadable" in caplog.text
    d.check_accounting([req])


def test_the_directory_and_files_are_private(tmp_path):
    """Another user's (here: a world-writable) directory is refused; written blocks are 0600 files and no
    temporary file is left; a block file others could write, or a link planted under a block's name, is
    never read even with the right content."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeCacheDir, match="world-writable"):
        make_cm(shared)
    a_dir = tmp_path / "a"
    a = make_cm(a_dir)
    prompt = prompt_of(BLOCK + 1)
    a.release(fill(a, prompt))
    assert a.disk.flush()
    (name,) = a.disk.block_names(prompt)
    files = sorted(a_dir.iterdir())
    assert [f.name for f in files] == [name + SUFFIX]
    assert all((f.stat().st_mode & 0o777) == 0o600 for f in files)
    block = a_dir / (name + SUFFIX)

    def loaded() -> int:
        cm = make_cm(a_dir)
        req = Req(rid="r", prompt_ids=prompt, params=SamplingParams(max_new_tokens=1))
        cm.match(req)
        assert cm.start(req)
        return req.disk_loaded_len

    assert loaded() == BLOCK  # the file as written is used
    os.chmod(block, 0o666)  # another user could have written it
    assert loaded() == 0
    os.chmod(block, 0o600)
    real = tmp_path / "elsewhere.kv"
    block.rename(real)
    block.symlink_to(real)  # a link planted under the block's name
    assert loaded() == 0 and real.exists()


def test_the_size_cap_drops_least_recently_used_files(tmp_path):
    one = make_cm(tmp_path)
    one.release(fill(one, prompt_of(BLOCK + 1)))
    assert one.disk.flush()
    size = os.path.getsize(next(iter(tmp_path.iterdir())))
    cm = make_cm(tmp_path, cap=int(2.5 * size))
    for base in (2000, 3000, 4000):
        cm.release(fill(cm, prompt_of(BLOCK + 1, base)))
        assert cm.disk.flush()
    assert len(os.listdir(tmp_path)) == 2 and cm.disk.info()["disk_tier_used_bytes"] <= 2.5 * size


def load_again(directory, prompt: list[int]) -> int:
    """A request for `prompt` on a fresh process over `directory`: the tokens it loads from disk."""
    cm = make_cm(directory)
    req = Req(rid="h", prompt_ids=prompt + [7], params=SamplingParams(max_new_tokens=1))
    cm.match(req)
    assert cm.start(req)
    return req.disk_loaded_len


def block_file_size(directory) -> int:
    """The bytes of one block's file, measured by writing one on a throwaway tier over `directory`."""
    one = make_cm(directory)
    one.release(fill(one, prompt_of(BLOCK + 1)))
    assert one.disk.flush()
    return os.path.getsize(next(iter(directory.iterdir())))


def test_the_size_cap_drops_the_least_hit_files_before_recently_used_ones(tmp_path):
    size = block_file_size(tmp_path / "probe")
    cm = make_cm(tmp_path / "d", cap=int(2.5 * size))
    hot, warm, new = prompt_of(BLOCK + 1, 2000), prompt_of(BLOCK + 1, 3000), prompt_of(BLOCK + 1, 4000)
    for p in (hot, warm):
        cm.release(fill(cm, p))
        assert cm.disk.flush()
    (hot_name,), (warm_name,) = cm.disk.block_names(hot), cm.disk.block_names(warm)
    for _ in range(3):  # hot: three device hits, reported to the disk tier at admission
        req = Req(rid="x", prompt_ids=hot + [7], params=SamplingParams(max_new_tokens=1))
        assert cm.match(req) == BLOCK + 1 and cm.start(req)
        cm.release(req, cache_tokens=False)
    cm.disk.hit([warm_name])  # warm: one hit, but the most recent use
    cm.release(fill(cm, new))  # written: one hit, fewer than either, so it is the one dropped
    assert cm.disk.flush()
    left = {p.name.removesuffix(SUFFIX) for p in (tmp_path / "d").iterdir()}
    assert left == {hot_name, warm_name}  # LRU would have dropped hot, the least recently used
    assert cm.disk.counts["disk_evicted"] == 1 and cm.disk.info()["disk_tier_used_bytes"] <= 2.5 * size


def test_old_hits_age_so_new_prefixes_still_reach_a_full_disk(tmp_path):
    size = block_file_size(tmp_path / "probe")
    cm = make_cm(tmp_path / "d", cap=int(2.5 * size))
    old = [prompt_of(BLOCK + 1, b) for b in (2000, 3000)]
    for p in old:
        cm.release(fill(cm, p))
        assert cm.disk.flush()
        cm.disk.hit(cm.disk.block_names(p) * 3)  # popular once, never used again
    news = [prompt_of(BLOCK + 1, 5000 + 1000 * i) for i in range(8)]
    for p in news:
        cm.release(fill(cm, p))
        assert cm.disk.flush()
    # each write evicts one file; the level rises with every eviction until old hits no longer outrank a
    # newly written block, and the latest prefix then stays on disk
    assert load_again(tmp_path / "d", news[-1]) == BLOCK
    assert all(load_again(tmp_path / "d", p) == 0 for p in old)
    assert len(list((tmp_path / "d").iterdir())) == 2


def test_a_graceful_stop_waits_for_room_in_the_writers_queue(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "QUEUE_BLOCKS", 1)
    real_save = torch.save

    def slow_save(*a, **kw):  # a slow disk: the writer falls behind and its queue stays full
        time.sleep(0.05)
        real_save(*a, **kw)

    monkeypatch.setattr(torch, "save", slow_save)
    cm = make_cm(tmp_path)
    prompt = prompt_of(3 * BLOCK + 1)
    cm.release(fill(cm, prompt))  # serving does not wait: with one place in the queue blocks are dropped
    cm.save_to_disk()  # the graceful stop waits for room instead
    assert sorted(os.listdir(tmp_path)) == sorted(n + SUFFIX for n in cm.disk.block_names(prompt))


def test_server_args_check_the_disk_tier(tmp_path):
    assert ServerArgs(kv_disk_dir=str(tmp_path)).kv_disk_gb == 10.0
    with pytest.raises(ValueError, match="--kv-disk-gb"):
        ServerArgs(kv_disk_dir=str(tmp_path), kv_disk_gb=0)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        ServerArgs(kv_disk_dir=str(tmp_path / "f"))
    with pytest.raises(ValueError, match="radix cache"):
        ServerArgs(kv_disk_dir=str(tmp_path), disable_radix_cache=True)


def test_the_weights_fingerprint_tells_models_at_the_same_path_apart(tmp_path):
    """The disk tier's identity hashes config.json and the weights' headers and sampled values: a fine-tune
    (same names, shapes and dtypes) or another RoPE base written over the same folder gets other names."""
    from safetensors.torch import save_file

    from runtime.models.model_loader import weights_fingerprint

    def write(seed: int, rope_theta: float) -> str:
        gen = torch.Generator().manual_seed(seed)
        tensors = {f"layer{i}.weight": torch.randn(256, 512, generator=gen) for i in range(3)}
        save_file(tensors, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text(f'{{"rope_theta": {rope_theta}}}')
        return weights_fingerprint(str(tmp_path))

    base = write(0, 10000.0)
    assert write(0, 10000.0) == base  # the same model again: the same identity (a restart reuses its KV)
    assert write(1, 10000.0) != base  # fine-tuned values, same shapes
    assert write(0, 500000.0) != base  # another RoPE base
