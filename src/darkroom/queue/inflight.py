"""The one owner of this worker's in-flight entries: which entries it holds (never one
twice), which of them the heartbeat keeps young, what each one claimed (the job whose
lease the heartbeat renews, and whose attempt number a failure is decided on), and how
many more it may take (DARKROOM_MAX_IN_FLIGHT, plus the interactive places), and how
many each lane holds. Render slots are the renderer's.
"""

from __future__ import annotations

from typing import Generic, TypeVar

C = TypeVar("C")


class InFlight(Generic[C]):
    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._entries: dict[str, bool] = {}  # entry id → the heartbeat keeps it young
        self._claims: dict[str, C] = {}  # entry id → what it claimed (only entries held)
        self._lanes: dict[str, str] = {}  # entry id → the lane it came through
        # entry id → every key its tries uploaded (a try whose publish reply was lost left
        # its own: a refusal met by a later try must delete those too)
        self._uploads: dict[str, list[str]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._entries

    def free(self) -> int:
        return max(0, self.bound - len(self._entries))

    def held(self, lane: str) -> int:
        return sum(1 for held in self._lanes.values() if held == lane)

    def admit(self, entry_id: str, lane: str = "interactive") -> bool:
        """Hold `entry_id`; False if it is already held (a reclaim of our own entry)."""
        if entry_id in self._entries:
            return False
        self._entries[entry_id] = True
        self._lanes[entry_id] = lane
        return True

    def claimed(self, entry_id: str, claim: C) -> None:
        if entry_id in self._entries:
            self._claims[entry_id] = claim

    def claim_of(self, entry_id: str) -> C | None:
        return self._claims.get(entry_id)

    def uploaded(self, entry_id: str, keys: list[str]) -> list[str]:
        """Adds this try's keys; every key of the entry's tries so far, first upload first."""
        if entry_id not in self._entries:
            return keys
        known = self._uploads.setdefault(entry_id, [])
        known.extend(k for k in keys if k not in known)
        return list(known)

    def settle(self, entry_id: str) -> None:
        """Its outcome is being recorded: the heartbeat must leave it alone from now on (a
        late heartbeat would cancel a retry's backoff)."""
        if entry_id in self._entries:
            self._entries[entry_id] = False

    def release(self, entry_id: str) -> None:
        self._entries.pop(entry_id, None)
        self._claims.pop(entry_id, None)
        self._lanes.pop(entry_id, None)
        self._uploads.pop(entry_id, None)

    def heartbeat_ids(self, lane: str | None = None) -> list[str]:
        """The young entries (of `lane`, or of every lane)."""
        young = (i for i, y in self._entries.items() if y)
        return sorted(i for i in young if lane is None or self._lanes[i] == lane)

    def young_claims(self) -> list[C]:
        """What the young entries claimed: the jobs whose leases the heartbeat renews."""
        return [c for i, c in self._claims.items() if self._entries.get(i)]

    def ids(self) -> list[str]:
        return sorted(self._entries)
