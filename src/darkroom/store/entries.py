"""The entries a job keeps as dropped (`photo_jobs.dropped_entries`): entries acked, or about
to be, that the job's current run does not go through (left alone by a claim, refused at a
publish or an unrecorded failure, or a run's that has ended), so a worker that read one of
them before and stalled takes nothing when it claims it later (store/leases.py, `spent`).
"""

from __future__ import annotations

# Kept per job: a stalled reader is safe unless more than this many of the photo's entries
# are dropped while it stalls (no producer, feeder or sweep sends one photo that many in a
# claim's idle time; a stall of any length is bounded by this, docs/reliability.md).
KEPT = 16


def appended(entry: str, job: str = "j") -> str:
    """SQL: `job`'s dropped entries with `entry` (an SQL expression) added, the last KEPT
    kept; unchanged when it is there already or NULL."""
    column = f"{job}.dropped_entries"
    return f"""CASE WHEN {entry} IS NULL OR {entry} = ANY({column}) THEN {column}
         ELSE ({column} || ({entry})::text)[greatest(1, cardinality({column}) - {KEPT - 2}):]
         END"""
