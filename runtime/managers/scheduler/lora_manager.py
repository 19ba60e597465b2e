"""The scheduler's LoRA adapters: which are served, which sit in the model's `max_loras` slots, and each
request's binding to one.

- Registered adapters (start-up `--lora-modules`, `POST /v1/load_lora_adapter`) are read and checked once
  and kept in host memory; a bad one is refused with the problem named and nothing changes.
- A slot holds one adapter for as long as some admitted request uses it (a reference count). An adapter not
  in a slot is copied into a free one at admission, else into the least recently used slot no request holds;
  with every slot held the request waits (the next step tries again).
- A request binds its adapter when it arrives (an unknown name is its 400), so unloading an adapter lets the
  requests already queued for it finish; its slot comes free when the last one does.
- The adapter's identity (the digest of its files) joins the request's cache salt, so KV computed under one
  adapter is never served to another or to the base model, on the device, host and disk tiers alike, and
  salted requests stay out of the shared speculative index (`drafting`). Same files, same identity: a
  reload after eviction or a restart finds its own KV again.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import msgspec

from runtime.messages import LoraResp
from runtime.models.lora import Adapter, LoraError, LoraPool, read_adapter

if TYPE_CHECKING:
    from runtime.managers.scheduler.req import Req
    from runtime.models.model_config import ModelConfig

logger = logging.getLogger("radixlm.lora")

MAX_ADAPTERS = 1024  # registered adapters (each kept in host memory)
MAX_NAME_CHARS = 256
_SEP = "\x1e"  # cannot occur in a client's cache salt nor a tenant name (`tenants.scoped_salt`)


def lora_salt(digest: str, salt: str | None) -> str:
    """The cache salt of a request under the adapter of `digest`: distinct from every salt without one (which
    cannot hold the separator) and from every other adapter's."""
    return f"{_SEP}lora{_SEP}{digest}" + ("" if salt is None else f"{_SEP}{salt}")


def check_name(name: Any) -> str:
    """An adapter name as the API takes it; LoraError naming the bound."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS or not name.isprintable():
        raise LoraError(f"'lora_name' must be a printable string of 1..{MAX_NAME_CHARS} chars")
    return name


class LoraManager:
    def __init__(self, pool: LoraPool, cfg: ModelConfig, max_rank: int):
        self.pool, self.cfg, self.max_rank = pool, cfg, max_rank
        self.adapters: dict[str, Adapter] = {}
        n = pool.max_loras
        self.slot_adapter: list[Adapter | None] = [None] * n
        self.slot_refs = [0] * n
        self.lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(n))  # least recent first
        self.stats = {"lora_slot_loads": 0, "lora_evictions": 0, "lora_slot_waits": 0}

    @classmethod
    def from_runner(cls, runner: Any, modules: tuple[str, ...], max_rank: int) -> LoraManager | None:
        """None when the runner serves no adapters; each NAME=PATH of `modules` registered (a bad one raises
        its LoraError: the server does not start with an adapter it was told to serve and cannot)."""
        if runner.lora is None:
            return None
        manager = cls(runner.lora, runner.config, max_rank)
        for spec in modules:
            name, _, path = spec.partition("=")
            manager.register(name, path)
        return manager

    # ---- the served set ----
    def register(self, name: str, path: str) -> Adapter:
        check_name(name)
        if name in self.adapters:
            raise LoraError(f"LoRA adapter {name!r} is already loaded (unload it first)")
        if len(self.adapters) >= MAX_ADAPTERS:
            raise LoraError(f"{MAX_ADAPTERS} LoRA adapters are loaded already; unload one first")
        adapter = read_adapter(name, path, self.cfg, self.max_rank)
        self.adapters[name] = adapter
        logger.info(
            "LoRA adapter %r loaded from %s: rank %d on %s", name, path, adapter.rank, adapter.targets
        )
        return adapter

    def unregister(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise LoraError(f"LoRA adapter {name!r} is not loaded")
        for slot, adapter in enumerate(self.slot_adapter):  # an idle slot of it is free at once
            if adapter is not None and adapter.name == name and not self.slot_refs[slot]:
                self.slot_adapter[slot] = None
        logger.info("LoRA adapter %r unloaded", name)

    def listing(self) -> list[dict[str, Any]]:
        return [
            {"name": a.name, "path": a.path, "rank": a.rank, "targets": list(a.targets), "digest": a.digest}
            for a in self.adapters.values()
        ]

    def salt_of(self, name: str, salt: str | None) -> str:
        """The cache salt requests under adapter `name` carry (`bind`'s), for a key built outside a request
        (a session's release); LoraError when `name` is not loaded."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise LoraError(f"LoRA adapter {name!r} is not loaded")
        return lora_salt(adapter.digest, salt)

    # ---- requests ----
    def bind(self, req: Req) -> str | None:
        """Tie a new request to its adapter and salt its cache key with the adapter's identity; the 400's
        message when the adapter is not loaded."""
        adapter = self.adapters.get(req.options.lora)
        if adapter is None:
            return f"LoRA adapter {req.options.lora!r} is not loaded"
        req.lora_adapter = adapter
        req.options = msgspec.structs.replace(
            req.options, cache_salt=lora_salt(adapter.digest, req.options.cache_salt)
        )
        return None

    def acquire(self, req: Req) -> bool:
        """Give an admitted request its adapter's slot; False when every slot is held by other adapters."""
        adapter = req.lora_adapter
        if adapter is None or req.lora_slot >= 0:
            return True
        slot = next((i for i, a in enumerate(self.slot_adapter) if a is adapter), None)
        if slot is None:
            slot = next((i for i in self.lru if not self.slot_refs[i]), None)  # least recent idle slot
            if slot is None:
                self.stats["lora_slot_waits"] += 1
                return False
            if self.slot_adapter[slot] is not None:
                self.stats["lora_evictions"] += 1
            self.pool.load(slot, adapter)
            self.slot_adapter[slot] = adapter
            self.stats["lora_slot_loads"] += 1
        self.slot_refs[slot] += 1
        self.lru.move_to_end(slot)
        req.lora_slot = slot
        return True

    def release(self, req: Req) -> None:
        slot = req.lora_slot
        if slot < 0:
            return
        req.lora_slot = -1
        self.slot_refs[slot] -= 1
        adapter = self.slot_adapter[slot]
        if (
            not self.slot_refs[slot]
            and adapter is not None
            and self.adapters.get(adapter.name) is not adapter
        ):
            self.slot_adapter[slot] = None  # unloaded while in use: free now that its last request is done

    def slots_of(self, reqs: list[Req]) -> list[int] | None:
        """Each request's slot in batch order (-1: base model); None when no request has an adapter."""
        slots = [r.lora_slot for r in reqs]
        for r, s in zip(reqs, slots):
            if r.lora_adapter is not None and s < 0:
                raise RuntimeError(f"request {r.rid[:64]} runs without its LoRA adapter's slot")
        return slots if any(s >= 0 for s in slots) else None

    def info(self) -> dict[str, Any]:
        return {
            "lora_adapters": sorted(self.adapters),
            "lora_slots": [a.name if a is not None else None for a in self.slot_adapter],
            **self.stats,
        }


def lora_control(manager: LoraManager | None, msg: Any) -> LoraResp:
    """Apply a `LoadLoraReq` / `UnloadLoraReq`; the reply lists the adapters served after it, or names why
    it was refused (nothing changed then)."""
    from runtime.messages import LoadLoraReq

    if manager is None:
        return LoraResp(
            adapters=[], error="this server serves no LoRA adapters (start it with --enable-lora)"
        )
    try:
        if isinstance(msg, LoadLoraReq):
            manager.register(msg.name, msg.path)
        else:
            manager.unregister(msg.name)
    except (LoraError, OSError) as e:  # OSError: a file that cannot be read (permissions, a directory)
        return LoraResp(adapters=manager.listing(), error=str(e))
    return LoraResp(adapters=manager.listing())
