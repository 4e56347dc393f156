"""Deferred renditions as part of the interleaving test (tests/test_interleavings.py): every
photo's list has a fast WebP and a deferred AVIF, so each interactive publish is followed by
an upgrade in the bulk lane, interleaved with re-renders, erases, reclaims and faults.
Promises: an upgrade only ever adds to the render it was claimed after (never to a newer
one, never to an erased photo: tests/interleave_erase.py checks that no event follows an
erase), and once quiescent every processed photo has its AVIF beside its fallback, unless
its upgrade failed for good.
An upgrade entry queues in the bulk stream behind the bulk photos fed before it, so plain
reads rarely leave one parked mid-flight: `take_upgrade` runs an interactive render to its
publish if no upgrade waits, then reads the bulk lane until a worker holds an upgrade, and
`upgrade_stalls` stalls that worker past its lease while a newer claim of the photo comes
(its entry reclaimed, a re-render, an erase), then lets it go on."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from darkroom import sweeper

# The renditions of every schedule's workers: the stand-in renderer makes one per entry.
RENDITIONS = "small:320:webp,small:320:avif"
# Bulk entries a worker reads, at most, looking for an upgrade (its in-flight places).
READS = 4
# What comes while an upgrade's worker stalls: another worker reclaims its entry, an operator
# re-renders the photo (another worker takes that), or erases it.
NEWER = ("reclaim", "rerender", "erase")

ROWS_SQL = """
SELECT p.id, p.processing_state, p.renditions::text AS renditions, j.state AS job_state
FROM photos p LEFT JOIN photo_jobs j ON j.photo_id = p.id AND j.type = 'process'
WHERE p.renditions IS NOT NULL
"""

# An upgrade waits for a worker: requested, and no live lease holds the photo's job.
DUE_SQL = """
SELECT EXISTS (SELECT 1 FROM photos p WHERE p.upgrade_requested_at IS NOT NULL
               AND p.processing_state = 'processed' AND NOT EXISTS (
                   SELECT 1 FROM photo_jobs j WHERE j.photo_id = p.id AND j.state = 'active'))
"""


class UpgradeRules:
    """Mixed into the machine (which provides root, rig, ledger, _do)."""

    root: Path
    rig: Any
    ledger: Any
    photos: list[uuid.UUID]
    settings: Any
    hands: list[Any]
    _do: Any
    _feed: Any
    _take: Any
    _step: Any
    _steppable: Any
    _audited: Any
    _rerender: Any
    _erase: Any
    freeze: Any
    unfreeze: Any
    time_passes: Any

    def _interactive(self) -> list[Any]:
        return [run for run in self._steppable() if run.entry.lane == "interactive"]

    def _upgrade_due(self) -> bool:
        return bool(self._do(self.rig.pool.fetchval(DUE_SQL)))

    @precondition(lambda self: self.photos)
    @rule(pick=st.integers(0, 3), index=st.integers(0, 2), steps=st.integers(0, 3),
          newer=st.sampled_from((None, *NEWER)), by=st.integers(0, 2),
          ahead=st.integers(0, 5))  # fmt: skip
    def take_upgrade(
        self, pick: int, index: int, steps: int, newer: str | None, by: int, ahead: int
    ) -> None:
        """With no upgrade waiting, an interactive render (one in flight, or the worker's
        next entry) runs to its end first (its publish adds its upgrade's entry); then a
        bulk entry already read claims, or a worker reads the bulk lane (its floor keeps
        bulk going beside interactive work), until one holds an upgrade, which runs `steps`
        calls further (the bulk photos read on the way stay parked after their claims);
        then, unless `newer` is None, it stalls as in `upgrade_stalls`."""
        worker = self.hands[index]
        if not worker.live:
            return
        if not self._upgrade_due():
            runs = self._interactive() or [self._do(self._take(worker, "new"))]
            if runs[0] is not None:
                self._run_out(runs[pick % len(runs)])
        run = self._do(self._take_upgrade(worker))
        note(f"{worker.name} takes an upgrade: {run!r}")
        for _ in range(steps if run is not None else 0):
            self._step(run)
        if run is not None and newer is not None and self._holds_upgrade(run):
            self._stall(run, newer, by, ahead)

    def _run_out(self, run: Any) -> None:
        for _ in range(40):  # as `finish`
            if run.done or not run.hand.live:
                return
            self._step(run)

    async def _take_upgrade(self, worker: Any) -> Any:
        for run in self._steppable():  # an entry read before: its claim decides what it is
            if run.entry.lane == "bulk" and run.at == "claim":
                await run.step()
                if self._holds_upgrade(run):
                    return run
        await self._feed()
        bulk = worker.streams.for_lane("bulk")
        for _ in range(READS):
            entries = await bulk.read_new(1, None)
            run = await worker.start(entries[0], 1) if entries else None
            if run is None:
                return None
            await run.step()  # its claim
            if self._holds_upgrade(run):
                return run
        return None

    @staticmethod
    def _holds_upgrade(run: Any) -> bool:
        claim = run.hand.jobs.in_flight.claim_of(run.entry.id)
        return not run.done and claim is not None and claim.upgrade and (
            claim.outcome == "claimed")  # fmt: skip

    def _upgrading(self) -> list[Any]:
        return [run for run in self._steppable() if self._holds_upgrade(run)]

    @precondition(lambda self: self._upgrading())
    @rule(pick=st.integers(0, 3), newer=st.sampled_from(NEWER), by=st.integers(0, 2),
          steps=st.integers(0, 5))  # fmt: skip
    def upgrade_stalls(self, pick: int, newer: str, by: int, steps: int) -> None:
        """The worker of an upgrade in flight stalls past its lease; a newer claim of the
        photo comes (`newer`) and runs `steps` calls ahead; the stalled worker wakes and
        its upgrade runs to its end: it may add nothing once its lease is not the newest."""
        self._stall(self._upgrading()[pick % len(self._upgrading())], newer, by, steps)

    def _stall(self, run: Any, newer: str, by: int, steps: int) -> None:
        stalled = self.hands.index(run.hand)
        self.freeze(stalled)
        if not run.hand.frozen:  # the only live worker: nobody else to come
            return
        self.time_passes()
        others = [w for w in self.hands if w.live]
        photo_id = uuid.UUID(run.entry.fields["photo_id"])
        came = self._do(self._newer(newer, others[by % len(others)], photo_id, run.entry.id))
        note(f"while {run!r} stalls, {newer}: {came!r}")
        for _ in range(steps if came is not None else 0):
            self._step(came)
        self.unfreeze(stalled)
        self._run_out(run)

    async def _newer(self, newer: str, worker: Any, photo_id: uuid.UUID, entry_id: str) -> Any:
        if newer == "erase":
            await self._erase(photo_id, False)
            return None
        if newer == "rerender":
            await self._audited("rerender", self._rerender(photo_id))
            return await self._take(worker, "new")
        return await self._reclaim(worker, entry_id)

    async def _reclaim(self, worker: Any, entry_id: str) -> Any:
        """XAUTOCLAIM of the bulk lane, each entry taken started as a worker would, until
        the stalled upgrade's entry is among them."""
        bulk, passes = worker.streams.for_lane("bulk"), 0
        for _ in range(2 * READS):
            entries, deleted = await bulk.reclaim(self.settings.claim_idle_ms, 1)
            await sweeper.requeue_deleted(self.rig.pool, bulk, deleted)
            if not entries:  # the end of a pass (its cursor kept from an earlier one)
                passes += 1
                if passes == 2:
                    return None
                continue
            run = await worker.start(entries[0], await bulk.deliveries(entries[0].id))
            if run is None or run.entry.id == entry_id:
                return run
        return None

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
