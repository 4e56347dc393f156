"""Late spans in the interleaving test (tests/test_interleavings.py): every delivery of the
schedule is traced (`install` gives each claim a span id), and between any two steps a late
writer with no grace takes the rows no exporter confirmed and settles them, as
latespans.LateSpans does once its export is confirmed. It must never take a `running` row of
a delivery that still holds its job under a live lease (that delivery's own span is still to
come: a late copy would be a second span, or one cut short), and its only write is
`span_sent`: no photo's or job's state moves under it."""

from __future__ import annotations

import uuid
from typing import Any

from hypothesis import note
from hypothesis.stateful import rule

from darkroom.store import spans
from tests.interleave import Hand, Rig, Run

STATES_SQL = """
SELECT p.id, p.processing_state, j.type, j.state, j.lease_token
FROM photos p LEFT JOIN photo_jobs j ON j.photo_id = p.id ORDER BY p.id, j.type
"""
JOBS_SQL = "SELECT photo_id, state, lease_token FROM photo_jobs WHERE type = 'process'"
# The rows whose spans no exporter confirmed, and whether a later delivery took the job since
# (a later row that is not one that found it busy, done or erased).
UNCONFIRMED_SQL = """
SELECT a.id, a.consumer, a.entry_id, a.ended_at, EXISTS (
    SELECT 1 FROM photo_attempts b
    WHERE b.photo_id = a.photo_id AND b.started_at > a.started_at
      AND b.outcome NOT IN ('busy', 'already', 'skipped')) AS superseded
FROM photo_attempts a WHERE a.span_id IS NOT NULL AND NOT a.span_sent
"""


class LateSpanRules:
    """Mixed into the machine: `late_pass` is a late writer's pass; `lapse` hears from the
    machine's `time passes` which claims lost their lease (no heartbeat renewed it)."""

    rig: Rig
    hands: list[Hand]
    dead: list[Hand]

    def __init__(self) -> None:
        super().__init__()
        self.late_taken: set[int] = set()  # rows a pass settled
        self.lapsed: dict[Run, int] = {}  # a run whose lease ran out: the claim's token then

    def _do(self, coro: Any) -> Any:
        raise NotImplementedError  # the machine's

    def lapse(self, kept: set[tuple[str, uuid.UUID]]) -> None:
        """Time passed: every claim but those of `kept` (holder, photo), the young claims of
        live workers, lost its lease."""
        for worker in self.hands + self.dead:
            for run in worker.parked():
                claim = worker.jobs.in_flight.claim_of(run.entry.id)
                if claim is None or claim.outcome != "claimed":
                    continue
                if (worker.jobs.holder, claim.photo_id) not in kept:
                    self.lapsed[run] = claim.token

    def _holding(self, jobs: dict[uuid.UUID, Any]) -> dict[tuple[str, str], Run]:
        """(consumer, entry) of each delivery that holds its job under a live lease, by the
        schedule: its worker not killed, its job not ended, its claim the job's current one
        (its grant the photo's newest, its token the job's) and not lapsed since."""
        runs = [run for worker in self.hands + self.dead for run in worker.runs]
        newest: dict[uuid.UUID, int] = {}
        for run in runs:
            claim = run.hand.jobs.in_flight.claim_of(run.entry.id)
            if run.grant is not None and claim is not None:
                newest[claim.photo_id] = max(newest.get(claim.photo_id, 0), run.grant)
        holding = {}
        for run in runs:
            claim = run.hand.jobs.in_flight.claim_of(run.entry.id)
            if run.done or run.killed or run.hand.dead or claim is None:
                continue
            job = jobs.get(claim.photo_id)
            if (
                claim.outcome == "claimed"
                and run.grant == newest.get(claim.photo_id)
                and job is not None
                and (job["state"], job["lease_token"]) == ("active", claim.token)
                and self.lapsed.get(run) != claim.token
            ):
                holding[(run.hand.name, run.entry.id)] = run
        return holding

    @rule()
    def late_pass(self) -> None:
        """A late writer's pass with no grace: what it takes, it writes and settles."""
        taken, holding, due, before, after = self._do(self._late_pass())
        note(f"late pass: {len(taken)} rows")
        missed = due - {row["id"] for row in taken}
        assert not missed, f"late pass left rows {sorted(missed)} whose spans are due"
        for row in taken:
            assert row["id"] not in self.late_taken, f"settled row {row['id']} taken again"
            self.late_taken.add(row["id"])
            if row["ended_at"] is not None:
                continue
            # a `running` row whose job names its consumer and entry under a live lease: its
            # delivery's own span is still to come (or, its worker restarted under that name
            # and reading its entry again, the new delivery's claim will answer it)
            held = holding.get((row["consumer"], row["entry_id"]))
            assert held is None, (
                f"late pass took running row {row['id']} ({row['consumer']}:{row['entry_id']}"
                f" of photo {row['photo_id']}) while {held!r} holds its job under a live lease"
            )
        assert before == after, f"a late pass moved a photo's or job's state: {before} -> {after}"

    async def _late_pass(self) -> tuple[list[Any], dict[tuple[str, str], Run], set[int], Any, Any]:
        pool = self.rig.pool
        before = [tuple(r) for r in await pool.fetch(STATES_SQL)]
        jobs = {r["photo_id"]: r for r in await pool.fetch(JOBS_SQL)}
        holding = self._holding(jobs)
        # due with no grace: a delivery that ended, or one that never did, whose job a later
        # delivery took, and that no live delivery of its consumer and entry holds (a worker
        # restarted under its name, reading its own entry again: the job names both)
        due = {
            r["id"]
            for r in await pool.fetch(UNCONFIRMED_SQL)
            if r["ended_at"] is not None
            or (r["superseded"] and (r["consumer"], r["entry_id"]) not in holding)
        }
        async with spans.unsent(pool, 0, 200) as batch:
            ids = [r.row_id for r in batch.rows]
            # the rows as the pass locked them: `running` or ended, and whose delivery (its
            # consumer and entry, as the job names it)
            taken = await batch.conn.fetch(
                "SELECT id, photo_id, entry_id, consumer, ended_at FROM photo_attempts"
                " WHERE id = ANY($1::bigint[]) ORDER BY id",
                ids,
            )
            await batch.settle(batch.rows)
        after = [tuple(r) for r in await pool.fetch(STATES_SQL)]
        return list(taken), holding, due, before, after
