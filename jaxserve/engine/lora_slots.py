"""Which LoRA adapter each device slot holds, and who is using it (host side, the scheduler's).

The runner has --max-loras slots (runner.set_lora_slot). A running request pins its adapter's
slot; an adapter no running request uses may be replaced, the least recently used first, so
adapters that come back often stay resident. A step thus never mixes more adapters than there
are slots; a request whose adapter finds no slot waits while others are admitted.
"""

from __future__ import annotations

import itertools
from typing import Any


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        self.adapter_ids: list[int | None] = [None] * num_slots  # lora_int_id held by each slot
        self.users = [0] * num_slots  # running requests pinning each slot
        self._last_used = [0] * num_slots
        self._clock = itertools.count(1)
        self._loads: list[tuple[int, Any]] = []  # (slot, LoRARequest) to write before the next step

    def acquire(self, lora_request) -> int | None:
        """The slot holding the request's adapter, pinned for it (written there first if it
        was not resident), or None when every slot is pinned by other adapters."""
        lora_id = lora_request.lora_int_id
        if lora_id in self.adapter_ids:
            slot = self.adapter_ids.index(lora_id)
        else:
            free = [s for s, users in enumerate(self.users) if users == 0]
            if not free:
                return None
            slot = min(free, key=lambda s: (self.adapter_ids[s] is not None, self._last_used[s]))
            self.adapter_ids[slot] = lora_id
            self._loads.append((slot, lora_request))
        self.users[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        self.users[slot] -= 1
        self._last_used[slot] = next(self._clock)

    def take_loads(self) -> tuple[tuple[int, Any], ...]:
        loads, self._loads = tuple(self._loads), []
        return loads

    def running_adapters(self) -> list[int]:
        return [a for a, users in zip(self.adapter_ids, self.users) if users and a is not None]
