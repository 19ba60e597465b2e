"""Stored responses for `previous_response_id`: the response object (for GET) and the conversation it ended
(for continuation), bounded by count and by bytes, least recently used out first.

Bytes are what the stored objects take in the Python heap (`heap_bytes`), not their JSON: a response echoes
parts of its request, and 8 MB of JSON such as `[[],[],...]` is ~170 MB of lists, so counting JSON let a
few requests keep over a gigabyte under a 64 MB bound.

Each stored response has an owner, the tenant that created it (None without --api-keys-file): another owner
finds nothing under its id (404, as for an id that never existed). Per owner, --tenant-max-stored-responses
and --tenant-max-stored-mb bound what it keeps: a request that would store past the count is refused up
front (`quota_problem`, HTTP 429); past the bytes the owner's own least recently used responses go first."""

from __future__ import annotations

import sys
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from runtime.entrypoints.wire.conversation import Message


@dataclass
class Stored:
    response: dict[str, Any]
    history: list[Message]  # the continued conversation: input (without instructions) + output
    size: int
    owner: str | None = None  # the tenant that stored it


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int, owner_max_count: int = 0, owner_max_bytes: int = 0):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.owner_max_count, self.owner_max_bytes = owner_max_count, owner_max_bytes  # 0: no bound
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        self.owner_count: Counter[str] = Counter()
        self.owner_bytes: Counter[str] = Counter()

    def quota_problem(self, owner: str | None) -> str | None:
        """Why `owner` may not store another response (HTTP 429), or None."""
        if owner is None or not self.owner_max_count or self.owner_count[owner] < self.owner_max_count:
            return None
        return (
            f"tenant quota --tenant-max-stored-responses ({self.owner_max_count}) reached: delete stored "
            "responses (DELETE /v1/responses/{id}) or send 'store': false"
        )

    def put(self, response: dict[str, Any], history: list[Message], owner: str | None = None) -> bool:
        """Store (evicting the least recently used: the owner's own first when it is past its bytes);
        False when one response alone exceeds a byte bound."""
        size = heap_bytes(response) + heap_bytes([m.to_json() for m in history])
        own_bound = self.owner_max_bytes if owner is not None else 0
        if size > self.max_bytes or self.max_count < 1 or (own_bound and size > own_bound):
            return False
        self.delete(response["id"], owner)
        while own_bound and self.owner_bytes[owner] + size > own_bound:
            self._drop(next(k for k, v in self.items.items() if v.owner == owner))
        self.items[response["id"]] = Stored(response, history, size, owner)
        self.bytes += size
        if owner is not None:
            self.owner_count[owner] += 1
            self.owner_bytes[owner] += size
        while len(self.items) > self.max_count or self.bytes > self.max_bytes:
            self._drop(next(iter(self.items)))
        return True

    def get(self, rid: str, owner: str | None = None) -> Stored | None:
        """The response `rid` when `owner` stored it; None otherwise (another tenant's is not found)."""
        item = self.items.get(rid)
        if item is None or item.owner != owner:
            return None
        self.items.move_to_end(rid)
        return item

    def delete(self, rid: str, owner: str | None = None) -> bool:
        item = self.items.get(rid)
        if item is None or item.owner != owner:
            return False
        self._drop(rid)
        return True

    def _drop(self, rid: str) -> None:
        item = self.items.pop(rid)
        self.bytes -= item.size
        if item.owner is not None:
            self.owner_count[item.owner] -= 1
            self.owner_bytes[item.owner] -= item.size
            if not self.owner_count[item.owner]:
                del self.owner_count[item.owner], self.owner_bytes[item.owner]


def heap_bytes(obj: Any) -> int:
    """`sys.getsizeof` summed over every object reachable from `obj` through dicts, lists and tuples, each
    object once: what a JSON-like value holds in the heap (~2x a flat string's UTF-8, ~20x nested lists')."""
    seen: set[int] = set()
    stack, total = [obj], 0
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        total += sys.getsizeof(x)
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total
