"""The entries a job keeps as dropped (`photo_jobs.dropped_entries`): acked by a delivery
that did not finish the job through them, so a worker that read one of them before and
stalled takes nothing when it claims it later (store/leases.py, `spent`).
"""

from __future__ import annotations

# Kept per job: a stalled reader claims within about DARKROOM_CLAIM_IDLE_MS of the entry's
# ack, and no producer or feeder sends a photo more entries than this meanwhile.
KEPT = 16


def appended(entry: str, job: str = "j") -> str:
    """SQL: `job`'s dropped entries with `entry` (an SQL expression) added, the last KEPT
    kept; unchanged when it is there already or NULL."""
    column = f"{job}.dropped_entries"
    return f"""CASE WHEN {entry} IS NULL OR {entry} = ANY({column}) THEN {column}
         ELSE ({column} || ({entry})::text)[greatest(1, cardinality({column}) - {KEPT - 2}):]
         END"""
