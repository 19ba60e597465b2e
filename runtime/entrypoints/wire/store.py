"""Stored responses for `previous_response_id`: the response object (for GET) and the conversation it ended
(for continuation), bounded by count and by bytes, least recently used out first.

Bytes are what the stored objects take in the Python heap (`heap_bytes`), not their JSON: a response echoes
parts of its request, and 8 MB of JSON such as `[[],[],...]` is ~170 MB of lists, so counting JSON let a
few requests keep over a gigabyte under a 64 MB bound."""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from runtime.entrypoints.wire.conversation import Message


@dataclass
class Stored:
    response: dict[str, Any]
    history: list[Message]  # the continued conversation: input (without instructions) + output
    size: int


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def put(self, response: dict[str, Any], history: list[Message]) -> bool:
        """Store (evicting the least recently used); False when one response alone exceeds the byte bound."""
        size = heap_bytes(response) + heap_bytes([m.to_json() for m in history])
        if size > self.max_bytes or self.max_count < 1:
            return False
        self.delete(response["id"])
        self.items[response["id"]] = Stored(response, history, size)
        self.bytes += size
        while len(self.items) > self.max_count or self.bytes > self.max_bytes:
            _, old = self.items.popitem(last=False)
            self.bytes -= old.size
        return True

    def get(self, rid: str) -> Stored | None:
        item = self.items.get(rid)
        if item is not None:
            self.items.move_to_end(rid)
        return item

    def delete(self, rid: str) -> bool:
        item = self.items.pop(rid, None)
        if item is not None:
            self.bytes -= item.size
        return item is not None


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
