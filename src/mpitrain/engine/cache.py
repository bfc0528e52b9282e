"""The response cache: negotiated requests remembered by bit, so that repeats cost one bit.

Training submits the same names with the same shapes every step.  The first time a name is
negotiated its metadata travels to every rank; once it has run, every rank stores it under the
same bit (all ranks insert in the same order, so they assign the same bits).  From then on a
rank that submits the name again only sets that bit in a vector that is AND-reduced: a bit set
everywhere means "ready everywhere".  Bits are stable slots; an evicted slot is reused lowest
first, which every rank also does identically.

When full, inserting evicts the least recently run entry.  Entries are inserted and touched
only when a response runs, and responses run in the same order on every rank, so every rank
evicts the same entry.  Without eviction, ever-growing unnamed names ("allreduce.noname.N")
would fill the cache and every later request would pay the full exchange.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class ResponseCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_name: dict[str, int] = {}
        self._entries: list[tuple[str, Any] | None] = []  # slot -> (name, meta)
        self._free: list[int] = []
        self._recent: OrderedDict[int, None] = OrderedDict()  # bits, least recently run first

    @property
    def num_bits(self) -> int:
        return len(self._entries)

    def __len__(self) -> int:
        return len(self._by_name)

    def lookup(self, name: str) -> int | None:
        return self._by_name.get(name)

    def entry(self, bit: int) -> tuple[str, Any] | None:
        return self._entries[bit] if bit < len(self._entries) else None

    def touch(self, bit: int) -> None:
        """Mark ``bit`` as just run (for least-recently-run eviction)."""
        if bit in self._recent:
            self._recent.move_to_end(bit)

    def insert(self, name: str, meta: Any) -> tuple[int | None, int | None]:
        """Remember ``name`` with ``meta``.

        Returns:
            (its bit or None when capacity is 0, the bit evicted to make room or None).
        """
        if name in self._by_name:
            bit = self._by_name[name]
            self._entries[bit] = (name, meta)
            self.touch(bit)
            return bit, None
        if self.capacity <= 0:
            return None, None
        evicted = None
        if len(self._by_name) >= self.capacity:
            evicted = next(iter(self._recent))
            self.evict(evicted)
        if self._free:
            self._free.sort()
            bit = self._free.pop(0)
            self._entries[bit] = (name, meta)
        else:
            bit = len(self._entries)
            self._entries.append((name, meta))
        self._by_name[name] = bit
        self._recent[bit] = None
        return bit, evicted

    def evict(self, bit: int) -> tuple[str, Any] | None:
        """Forget the entry at ``bit`` (if any) and return it."""
        found = self.entry(bit)
        if found is None:
            return None
        self._entries[bit] = None
        del self._by_name[found[0]]
        self._recent.pop(bit, None)
        self._free.append(bit)
        return found

    def assigned_bits(self) -> list[int]:
        return [i for i, e in enumerate(self._entries) if e is not None]
