"""What lpm's ordering costs per scheduling round with KV tiers: a full queue (LPM_MAX_QUEUE requests) of
agent resumes whose histories sit on the device, the host tier or the disk tier, ranked by
`order_waiting("lpm")` (device match + tier match) against the device match alone (the ranking before
tiers counted). Real CacheManager, radix trees, HostTier and DiskTier over a tiny KV layout (the cost is the
token keys', not the KV's). The first round hashes each disk candidate's block names once; later rounds
reuse them.

    python -m bench.lpm_order_cost [--history 1500] [--rounds 30]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import torch

from runtime.managers.scheduler.cache_manager import CacheManager
from runtime.managers.scheduler.req import Req
from runtime.managers.scheduler.schedule_policy import LPM_MAX_QUEUE, order_waiting
from runtime.mem_cache.disk_tier import DiskTier
from runtime.mem_cache.host_tier import HostTier
from runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool, SlotAllocator
from runtime.mem_cache.radix_cache import RadixCache
from runtime.sampling_params import SamplingParams


def build(directory: str, n: int, history: int, seed: int) -> tuple[CacheManager, list[Req]]:
    pool_tokens = n * (history + 128)
    kv = KVPool(pool_tokens, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    cm = CacheManager(
        RadixCache(),
        ReqToTokenPool(4, history + 128),
        SlotAllocator(pool_tokens),
        HostTier(kv, pool_tokens),
        DiskTier(directory, 1 << 34, kv, "lpm-order-cost"),
    )
    rng = random.Random(seed)
    waiting = []
    for i in range(n):
        key = [100_000 + i] + [rng.randrange(50_000) for _ in range(history - 1)]  # no shared first token
        slots = cm.allocator.alloc(history)
        where = i % 3
        if where == 0:
            cm.cache.insert(key, slots)  # on the device
        else:
            if where == 1:
                cm.host.save(key, slots)  # on the host only
            else:
                cm.disk.offer(key, slots, wait_s=10.0)  # on disk only
            cm.allocator.free(slots)
        prompt = key + [rng.randrange(50_000) for _ in range(65)]  # the tool result: new tokens
        waiting.append(Req(rid=f"a{i}", prompt_ids=prompt, params=SamplingParams(max_new_tokens=8)))
    assert cm.disk.flush(120.0)
    rng.shuffle(waiting)
    return cm, waiting


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queue", type=int, default=LPM_MAX_QUEUE)
    p.add_argument("--history", type=int, default=1500)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        cm, waiting = build(d, args.queue, args.history, args.seed)
        t = time.perf_counter()
        order_waiting("lpm", waiting, cm)
        first_ms = (time.perf_counter() - t) * 1e3
        tiered, device_only = [], []
        for _ in range(args.rounds):
            t = time.perf_counter()
            order_waiting("lpm", waiting, cm)
            tiered.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            for r in waiting:  # the ranking before: the device match alone
                cm.match(r)
            sorted(waiting, key=lambda r: (-r.match_len, r.arrival))
            device_only.append((time.perf_counter() - t) * 1e3)
        out = {
            "queue": args.queue,
            "history_tokens": args.history,
            "first_round_ms": round(first_ms, 2),
            "tiered_round_ms_p50": round(statistics.median(tiered), 2),
            "tiered_round_ms_max": round(max(tiered), 2),
            "device_only_round_ms_p50": round(statistics.median(device_only), 2),
            "tier_ranked_requests": sum(1 for r in waiting if r.tier_match_len),
            "disk_loaded_tokens": cm.disk.counts["disk_loaded_tokens"],  # ordering reads no file: 0
        }
        print(json.dumps(out, indent=1))
        cm.disk.close()


if __name__ == "__main__":
    main()
