"""Stored responses for `previous_response_id`: the response object (for GET) and the conversation it ended
(for continuation), bounded by count and by bytes, least recently used out first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from runtime.entrypoints.http_common import dumps
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
        size = len(dumps(response)) + len(dumps([m.to_json() for m in history]))
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
