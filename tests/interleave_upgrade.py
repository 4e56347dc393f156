"""Deferred renditions as part of the interleaving test (tests/test_interleavings.py): every
photo's list has a fast WebP and a deferred AVIF, so each interactive publish is followed by
an upgrade in the bulk lane, interleaved with re-renders, erases, reclaims and faults.
Promises: an upgrade only ever adds to the render it was claimed after (never to a newer
one, never to an erased photo: tests/interleave_erase.py checks that no event follows an
erase), and once quiescent every processed photo has its AVIF beside its fallback, unless
its upgrade failed for good."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from hypothesis.stateful import invariant

# The renditions of every schedule's workers: the stand-in renderer makes one per entry.
RENDITIONS = "small:320:webp,small:320:avif"

ROWS_SQL = """
SELECT p.id, p.processing_state, p.renditions::text AS renditions, j.state AS job_state
FROM photos p LEFT JOIN photo_jobs j ON j.photo_id = p.id AND j.type = 'process'
WHERE p.renditions IS NOT NULL
"""


class UpgradeRules:
    """Mixed into the machine (which provides root, rig, ledger, _do)."""

    root: Path
    rig: Any
    ledger: Any
    _do: Any

    @invariant()
    def an_upgrade_fits_its_render(self) -> None:
        """A manifest's AVIF was rendered under a claim granted after the one that rendered
        its WebP, and no publish was accepted after the upgrade that added it."""
        self._do(self._fits())

    async def _fits(self) -> None:
        for row in await self.rig.pool.fetch(ROWS_SQL):
            grants = self._grants(row["renditions"])
            if "avif" not in grants:
                continue
            if "webp" not in grants:
                raise AssertionError(f"{row['id']}: an AVIF without its fallback: {grants}")
            if grants["avif"] < grants["webp"]:
                raise AssertionError(f"{row['id']}: AVIF of grant {grants['avif']} beside the "
                                     f"WebP of a newer render, grant {grants['webp']}")  # fmt: skip
            if grants["avif"] > grants["webp"]:  # an upgrade's: the last finish of the photo
                last = self.ledger.finished.get(row["id"], [])[-1:]
                if last != [(grants["avif"], "publish_upgrade")]:
                    raise AssertionError(f"{row['id']}: upgraded by grant {grants['avif']}, "
                                         f"last accepted finish {last}")  # fmt: skip

    def _grants(self, renditions: str) -> dict[str, int]:
        """Each rendition's format → the grant its stand-in bytes name (`...:gN:format`)."""
        grants = {}
        for r in msgspec.json.decode(renditions):
            path = self.root / r["key"]
            if path.exists():
                grants[r["format"]] = int(path.read_text().rsplit(":", 2)[1].removeprefix("g"))
        return grants

    async def upgrades_done(self) -> None:
        """Once quiescent, every processed photo lists its AVIF (bulk renders have it inline,
        interactive ones by their upgrade), unless its last run failed for good."""
        for row in await self.rig.pool.fetch(ROWS_SQL):
            formats = [r["format"] for r in msgspec.json.decode(row["renditions"])]
            if row["processing_state"] != "processed" or row["job_state"] == "failed":
                continue
            if sorted(formats) != ["avif", "webp"]:
                raise AssertionError(f"{row['id']} lists {formats} after the drain")
