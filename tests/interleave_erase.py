"""`darkroom erase` as a step of the interleaving test (tests/test_interleavings.py): an
operator erases a photo (its original too, or not) between any two calls of the workers'
jobs. Promises: an erased photo stays erased and is never published after the erase
committed; once quiescent (drained, and `darkroom gc` past its grace), none of its objects
is left in storage."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from darkroom.operate import erase, gc
from darkroom.store import audit

# Per erased photo: its state and renditions, and whether an event follows its erase event
# (a publish, a re-render or a failure accepted after the erase committed).
ERASED_SQL = """
SELECT p.id, p.processing_state, p.renditions IS NULL AS nulled, EXISTS (
    SELECT 1 FROM photo_events later WHERE later.photo_id = p.id AND later.id > (
        SELECT min(e.id) FROM photo_events e
        WHERE e.photo_id = p.id AND e.type = 'darkroom.photo.erased')) AS after
FROM photos p WHERE p.id = ANY($1::uuid[])
"""


# Deliveries that ended otherwise than with a settled outcome (a killed one stays `running`;
# one whose refused publish lost its reply may end `failed` or `retrying`).
UNCLEAN_SQL = """
SELECT DISTINCT photo_id FROM photo_attempts
WHERE photo_id = ANY($1::uuid[])
  AND outcome NOT IN ('published', 'skipped', 'already', 'busy', 'lease_lost')
"""


def action() -> audit.Action:
    """Each erase its own action in the trail (one `started`, one ending)."""
    return audit.Action(operator="harness", via="cli", action="erase", reason="interleaving")


class EraseRules:
    """Mixed into the machine (which provides photos, storage, root, rig, _do)."""

    photos: list[uuid.UUID]
    storage: Any
    root: Path
    rig: Any
    dead: list[Any]
    _do: Any

    def __init__(self) -> None:
        self.erased: dict[uuid.UUID, bool] = {}  # erased photo → its original erased too
        super().__init__()

    @precondition(lambda self: self.photos)
    @rule(pick=st.integers(0, 3), original=st.booleans())
    def erase(self, pick: int, original: bool) -> None:
        """`darkroom erase ID [--original]`: the row commits, then its objects go."""
        photo_id = self.photos[pick % len(self.photos)]
        tally = self._do(self._erase(photo_id, original))
        note(f"erase {photo_id.int}{' --original' if original else ''}: {tally}")

    async def _erase(self, photo_id: uuid.UUID, original: bool) -> dict[str, int]:
        tally = await erase.erase_photos(
            self.rig.pool, self.storage, [photo_id], action(), original=original,
            dry_run=False, say=lambda _: None,
        )  # fmt: skip
        self.erased[photo_id] = self.erased.get(photo_id, False) or original
        return dict(tally)

    @invariant()
    def erased_stays_erased(self) -> None:
        """No write after an erase's commit changes the photo or publishes it."""
        if self.erased:
            self._do(self._erased_stays_erased())

    async def _erased_stays_erased(self) -> None:
        for row in await self.rig.pool.fetch(ERASED_SQL, list(self.erased)):
            if row["processing_state"] != "erased" or not row["nulled"] or row["after"]:
                raise AssertionError(f"{row['id']} changed after its erase: {dict(row)}")

    async def erased_left_nothing(self) -> None:
        """Once quiescent, no object of an erased photo is left: none at all unless a
        delivery of it did not end cleanly (its worker killed between its upload and its
        publish; a lost reply, then a failure: the uploads of the try before are named by
        nothing any more), and none once `darkroom gc` has collected what those left."""
        killed = {run.entry.fields.get("photo_id") for w in self.dead for run in w.runs}
        rows = await self.rig.pool.fetch(UNCLEAN_SQL, list(self.erased))
        excused = killed | {str(row["photo_id"]) for row in rows}
        for photo_id in self.erased:
            if str(photo_id) not in excused and (left := self._left(photo_id)):
                raise AssertionError(f"erased {photo_id} left {left}, every delivery clean")
        await gc.collect(self.rig.pool, self.storage, older_than_s=gc.MIN_GRACE_S,
                         now_s=time.time() + gc.GRACE_S, dry_run=False,
                         say=lambda _: None)  # fmt: skip
        for photo_id in self.erased:
            if left := self._left(photo_id):
                raise AssertionError(f"erased {photo_id} left {left} after gc")

    def _left(self, photo_id: uuid.UUID) -> list[Path]:
        folder = self.root / "renditions" / str(photo_id)
        left = [p for p in folder.rglob("*") if p.is_file()]
        original = self.root / "originals" / str(photo_id)
        return left + ([original] if self.erased[photo_id] and original.exists() else [])
